"""Shared fixtures: tiny random HF checkpoints written to disk, and the default model."""

from __future__ import annotations

import os

import pytest
import torch

# Tests are about correctness, not speed: keep BLAS single-threaded results reproducible and cheap.
torch.set_num_threads(min(2, os.cpu_count() or 1))
# An engine's start-up freezes the heap after a full collection (engine/startup_heap.py): 0.2 s an engine in a test
# process of ~400k objects, 80 s over the suite's engines. Off here; tests/engine/test_startup_heap.py turns it on.
os.environ.setdefault("DEEPSERVE_GC_FREEZE", "0")

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, head_dim=16, rms_norm_eps=1e-6)


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of many tiny ops: on 2 shared cores two OpenMP threads spin against each other (a forward of the
    tiny V4.1 reference took 2.4 s instead of 13 ms). Use with `pytestmark = pytest.mark.usefixtures(...)`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def save_tiny_model(path, kind: str, seed: int = 0) -> str:
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    extra = {"tie_word_embeddings": kind != "llama"}
    model = model_cls(config_cls(**TINY, **extra)).eval()
    # Random init makes near-uniform logits; sharpen them so greedy decoding is not decided by ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from deepserve.loader.gguf_loader import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def smollm(default_model_path):
    """The default model in one shared engine (loading it is the slow part)."""
    from deepserve import LLM
    return LLM(default_model_path, max_model_len=2048, seed=0)


@pytest.fixture(scope="session")
def hf_smollm(default_model_path):
    """HF transformers' own import of the default GGUF (float32, eval), the independent reference of the loader and
    model tests: one import per session (it takes about 25 s on 2 cores)."""
    transformers = pytest.importorskip("transformers")
    d, name = os.path.split(default_model_path)
    return transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()

