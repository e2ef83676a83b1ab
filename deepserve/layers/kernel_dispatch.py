"""Which implementation a layer runs: the Triton kernel for CUDA tensors when Triton imports, else the PyTorch
reference. Decided per call from the tensor's device (a cheap test, and it lets one model object serve CPU tests
and GPU runs); Triton is imported on first use on a CUDA tensor, so the CPU path never imports it."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _triton_available() -> bool:
    from deepserve.kernels import HAS_TRITON, INTERPRET
    return HAS_TRITON and not INTERPRET


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and _triton_available()
