"""Model building without PyTorch's random init: zeros in the building thread only, torch.nn.init restored after,
and a checkpoint that lacks a parameter still refused (a zero-filled weight must never be served)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from deepserve import LLM
from deepserve.worker.model_loader import _INITIALISERS, _parameters_left_at_zero


def test_modules_built_inside_are_zero_and_other_threads_still_draw():
    originals = {name: getattr(nn.init, name) for name in _INITIALISERS}
    elsewhere = {}
    inside_started, built_elsewhere = threading.Event(), threading.Event()

    def build_elsewhere():
        inside_started.wait(10)
        torch.manual_seed(0)
        elsewhere["linear"] = nn.Linear(64, 64)
        built_elsewhere.set()

    thread = threading.Thread(target=build_elsewhere)
    thread.start()
    with _parameters_left_at_zero():
        inside_started.set()
        linear, embedding = nn.Linear(64, 64), nn.Embedding(100, 16)
        built_elsewhere.wait(10)
    thread.join()
    assert not linear.weight.any() and not linear.bias.any() and not embedding.weight.any()
    assert elsewhere["linear"].weight.abs().sum() > 0 and elsewhere["linear"].weight.std() > 0.01
    assert all(getattr(nn.init, name) is fn for name, fn in originals.items())
    assert nn.Linear(8, 8).weight.std() > 0.01          # after the block: random init again


def test_a_checkpoint_missing_a_weight_is_refused(tmp_path, tiny_llama):
    from safetensors.torch import load_file, save_file

    target = tmp_path / "model"
    target.mkdir()
    for item in Path(tiny_llama).iterdir():
        if item.suffix != ".safetensors":
            (target / item.name).write_bytes(item.read_bytes())
    tensors = load_file(f"{tiny_llama}/model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(target / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks weights for: layers\.1\.mlp\.down_proj\.weight"):
        LLM(str(target), skip_tokenizer_init=True, max_model_len=128)
