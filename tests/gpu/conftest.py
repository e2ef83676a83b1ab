"""GPU kernel tests: every Triton kernel against its PyTorch twin. Skipped without CUDA + Triton.

Locally, `TRITON_INTERPRET=1` runs them on the CPU through Triton's interpreter (slow; bf16 matrix products are
wrong in the interpreter, so those cases skip there)."""

import pytest
import torch

from deepserve.kernels import HAS_TRITON, INTERPRET


def kernel_device():
    if not HAS_TRITON:
        return None
    if INTERPRET:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else None


@pytest.fixture(autouse=True)
def _needs_kernels():
    if kernel_device() is None:
        pytest.skip("needs CUDA and Triton (or TRITON_INTERPRET=1 with Triton installed)")


@pytest.fixture(autouse=True)
def _alone_on_the_gpu(request):
    """Tests marked `gpu_alone` size the KV cache from the GPU's free memory (gpu_memory_utilization near 1): beside
    other pytest-xdist workers on the same GPU they would take the memory those workers need, and see theirs. They
    run in a plain pytest run (README: `python -m pytest -q tests/gpu -m gpu_alone`), not under `-n`."""
    import os
    if request.node.get_closest_marker("gpu_alone") and os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.skip("needs the GPU to itself: run without -n (python -m pytest -q tests/gpu -m gpu_alone)")


@pytest.fixture
def device() -> str:
    return kernel_device()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory) -> str:
    """Qwen3-MoE, 8 experts top-2, layer 1 dense between MoE layers 0 and 2 (tests/gpu/test_mixed_graph_gpu.py,
    test_engine_gpu.py)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=16, max_position_embeddings=512, num_hidden_layers=3,
                                      intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                                      num_experts_per_tok=2, mlp_only_layers=[1])
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
    path = str(tmp_path_factory.mktemp("qwen3_moe"))
    model.save_pretrained(path)
    return path
