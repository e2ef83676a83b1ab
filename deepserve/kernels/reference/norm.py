"""RMS norm: the twin of kernels/norm.py (and of the GEMV prologue norms in kernels/gemv.py)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in fp32 whatever the activation dtype, as HF transformers does.
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """`rms_norm(x)`; with `residual`, `(rms_norm(x + residual), x + residual)` (the residual add rounds to x's
    dtype first, as two separate ops would)."""
    if residual is not None:
        x = x + residual
        residual = x
    out = rms_norm(x, weight, eps)
    return out if residual is None else (out, residual)


__all__ = ["add_rms_norm", "rms_norm"]
