"""mHC: manifold-constrained hyper-connections (DeepSeek-V4 / V4.1; deepinfer.md §2.4, §16.5).

The residual stream is m streams wide: a trunk R [T, m, H]. Each sublayer (attention, MoE) reads one mix of the
streams and writes its output back into every stream through a doubly stochastic matrix:

    mix  = (fn · flatten(R)) · rsqrt(mean(R²) + eps) ⊙ scale + base        one GEMV per token, fp32
    pre  = sigmoid(mix[:m]) + hc_eps          which streams the sublayer reads
    post = 2 · sigmoid(mix[m:2m])             how much of its output each stream gets
    C    = Sinkhorn(mix[2m:] as m x m)        how the streams mix among themselves (C[i, j]: stream i -> j)
    u = Σ_i pre_i R_i  ->  y = F(norm(u))  ->  R'_j = post_j · y + Σ_i C[i, j] R_i

Shifted (V4.1's default): sublayer s reads the streams with the `pre` computed at sublayer s-1 (the first with the
one-hot (1, 0, ...)), and the final hidden is the last sublayer's pre applied to the final trunk. Non-shifted (V4):
each sublayer uses its own pre, and an HC head (its own fn/base/scale) makes the final hidden.

Everything is per token, so a varlen batch is just T rows. Parameters are fp32, as the checkpoint stores them.
"""

from __future__ import annotations

import torch
from torch import nn

from deepserve.kernels.reference import hyper_connection as reference
from deepserve.kernels.reference.hyper_connection import first_pre, sinkhorn  # noqa: F401
from deepserve.layers.kernel_dispatch import use_triton


def hc_mix(R, fn, base, scale, norm_eps, hc_eps, iters, post_mult):
    """(pre, post, C) of the trunk R: one Triton launch on a GPU (GEMV + Sinkhorn in registers), else the twin."""
    if use_triton(R):
        from deepserve.kernels.hyper_connection import hc_mix as kernel
        return kernel(R, fn, base, scale, norm_eps, hc_eps, iters, post_mult)
    return reference.hc_mix(R, fn, base, scale, norm_eps, hc_eps, iters, post_mult)


def combine_streams(R: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_i w_i R_i -> [T, H] (see the twin)."""
    if use_triton(R):
        from deepserve.kernels.hyper_connection import combine_streams as kernel
        return kernel(R, weights)
    return reference.combine_streams(R, weights)


def write_back(R: torch.Tensor, y: torch.Tensor, post: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """R'_j = post_j · y + Σ_i C[i, j] R_i (see the twin)."""
    if use_triton(R):
        from deepserve.kernels.hyper_connection import write_back as kernel
        return kernel(R, y, post, C)
    return reference.write_back(R, y, post, C)


class HyperConnection(nn.Module):
    """One sublayer's mixing parameters: `{name}_base` [m(m+2)], `{name}_fn` [m(m+2), m·H], `{name}_scale` [3],
    registered on `owner` under the checkpoint's names (hc_attn_*, hc_ffn_*)."""

    def __init__(self, m: int, hidden: int, norm_eps: float, hc_eps: float, sinkhorn_iters: int,
                 post_mult: float = 2.0) -> None:
        super().__init__()
        self.m, self.norm_eps, self.hc_eps, self.iters, self.post_mult = m, norm_eps, hc_eps, sinkhorn_iters, post_mult
        n = m * (m + 2)
        self.base = nn.Parameter(torch.empty(n, dtype=torch.float32))
        self.fn = nn.Parameter(torch.empty(n, m * hidden, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def forward(self, R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """R [T, m, H] -> (pre [T, m], post [T, m], C [T, m, m]), fp32."""
        return hc_mix(R, self.fn, self.base, self.scale, self.norm_eps, self.hc_eps, self.iters, self.post_mult)


class HyperHead(nn.Module):
    """The non-shifted variant's final mix: `hc_head_fn` [m, m·H], `hc_head_base` [m], `hc_head_scale` [1];
    w = sigmoid((fn · z) · rsqrt(mean(z²) + rms_eps) · scale + base) + hc_eps; h = Σ_i w_i R_i (§16.5)."""

    def __init__(self, m: int, hidden: int, norm_eps: float, hc_eps: float) -> None:
        super().__init__()
        self.norm_eps, self.hc_eps = norm_eps, hc_eps
        self.fn = nn.Parameter(torch.empty(m, m * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(m, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, R: torch.Tensor) -> torch.Tensor:
        z = R.reshape(R.shape[0], -1).float()
        mix = (z @ self.fn.T) * torch.rsqrt(z.square().mean(-1, keepdim=True) + self.norm_eps)
        return combine_streams(R, torch.sigmoid(mix * self.scale + self.base) + self.hc_eps)
