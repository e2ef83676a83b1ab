"""The NeoX "rotate half" rotation: the twin of kernels/rotary.py and of the rotations fused into cache writes."""

from __future__ import annotations

import torch


def apply_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [.., D] rotated by cos, sin [.., D] (both halves of the cos/sin cache row, broadcast over heads),
    in float32, rounded once to x's dtype."""
    dtype = x.dtype
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos + rotated * sin).to(dtype)


def rotate_at(positions: torch.Tensor, x: torch.Tensor, cos_cache: torch.Tensor,
              sin_cache: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D] rotated at `positions` [T] with rows of the [max_position, D] caches."""
    return apply_rotate_half(x, cos_cache[positions].unsqueeze(1), sin_cache[positions].unsqueeze(1))


__all__ = ["rotate_at", "apply_rotate_half"]
