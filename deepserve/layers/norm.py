"""RMSNorm, optionally fused with the residual add that precedes it (saves one pass over memory)."""

from __future__ import annotations

import torch
from torch import nn

from deepserve.kernels.reference.moe import PairRows
from deepserve.kernels.reference.norm import add_rms_norm, rms_norm  # noqa: F401 (rms_norm: for models)
from deepserve.layers.kernel_dispatch import use_triton


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor | PairRows, residual: torch.Tensor | None = None):
        """`norm(x)`; with `residual`, returns `(norm(x + residual), x + residual)`. x may be a MoE layer's output
        before its combine (PairRows, models/base.py DecoderLayer): the GPU kernel sums its rows as it loads them."""
        if isinstance(x, PairRows):
            if residual is not None and use_triton(residual):
                from deepserve.kernels.norm import combine_add_rms_norm
                return combine_add_rms_norm(x, residual, self.weight, self.eps)
            x = x.combined()
        if use_triton(x):       # one pass: add, statistics, scale (the reference makes five)
            from deepserve.kernels.norm import fused_add_rms_norm
            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)
