"""Build a model from its config and fill its weights: HF safetensors, GGUF, or random ("dummy")."""

from __future__ import annotations

import glob
import os
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from deepserve.config import ModelConfig
from deepserve.layers.batch_invariant import make_batch_invariant
from deepserve.layers.quantization import quantize_model
from deepserve.models.registry import get_model_class


def load_model(config: ModelConfig, device: torch.device) -> nn.Module:
    cls = get_model_class(config.architecture)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype if config.dtype.is_floating_point else old_dtype)
    try:
        with torch.device(device):
            extra = {"keep_mtp": True} if config.keep_mtp else {}
            if extra and not hasattr(cls, "mtp_logits"):
                raise ValueError(f"speculative_config method 'mtp' needs a model with MTP layers (DeepSeek-V3); "
                                 f"{config.architecture} has none")
            model = cls(config.hf_config, max_position=config.max_model_len, **extra)
    finally:
        torch.set_default_dtype(old_dtype)
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
    else:
        # A model with its own checkpoint format (validated as a whole before reading, e.g. DeepSeek-V4.1's
        # FP8 / FP4 release) reads the directory itself.
        if hasattr(model, "load_checkpoint") and not config.is_gguf:
            loaded = model.load_checkpoint(config.model)
        else:
            loaded = model.load_weights(iter_checkpoint(config.model))
        missing = _expected_params(model) - loaded
        if missing:
            raise ValueError(f"checkpoint {config.model} lacks weights for: {', '.join(sorted(missing)[:8])}")
    model = quantize_model(model, config.quantization).eval()
    return make_batch_invariant(model, device) if config.batch_invariant else model


def iter_checkpoint(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    if path.endswith(".gguf"):
        from deepserve.loader.gguf_loader import load_gguf
        yield from load_gguf(path).tensors()
        return
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights of the right shapes, for speed work without a checkpoint (reproducible by seed)."""
    generators: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            # Drawn on the parameter's own device: billions of values on a GPU take a moment, on a CPU minutes.
            gen = generators.setdefault(param.device, torch.Generator(device=param.device).manual_seed(seed))
            param.normal_(0.0, 0.02, generator=gen)


def _expected_params(model: nn.Module) -> set[str]:
    return {name for name, _ in model.named_parameters()}
