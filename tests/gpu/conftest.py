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


@pytest.fixture
def device() -> str:
    return kernel_device()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
