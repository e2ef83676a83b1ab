"""RMSNorm, optionally fused with the residual add that precedes it (saves one pass over memory)."""

from __future__ import annotations

import torch
from torch import nn

from deepserve.layers.kernel_dispatch import use_triton


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """`norm(x)`; with `residual`, returns `(norm(x + residual), x + residual)`."""
        if use_triton(x):       # one pass: add, statistics, scale (the reference makes five)
            from deepserve.kernels.norm import fused_add_rms_norm
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
            residual = x
        out = rms_norm(x, self.weight, self.eps)
        return out if residual is None else (out, residual)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in fp32 whatever the activation dtype, as HF transformers does.
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)
