"""Interleaved RoPE of DeepSeek-V4 / V4.1 (deepinfer.md §2.12): the GPU twin of
`kernels/reference/sparse_attention.rope_interleaved` applied at table positions, in one launch.

    out[t, h, :D-R]      = x[t, h, :D-R]                                       (the non-rotary dims pass through)
    out[t, h, D-R+2i]    = x0 cos(p, i) - x1 sin(p, i)                          x0, x1 = x[t, h, D-R+2i], x[.., +1]
    out[t, h, D-R+2i+1]  = x0 sin(p, i) + x1 cos(p, i)                          p = positions[t]; inverse: -sin

The PyTorch twin is about a dozen launches (two table gathers, the split into pairs, four products, the stack and
the concatenation), and a V4.1 layer rotates 3-6 tensors per step (queries, keys, the attention output back,
indexer queries, new compressed entries, index keys): at batch-1 decode those launches are a sizeable share of a
step replayed from a CUDA graph. One program per (row, tile of BLOCK_H heads) loads its [BLOCK_H, D] tile once,
reads each element's pair partner with a second (cached) load and writes the tile, all in float32, rounded once to
x's dtype (the twin's order: the products and the sum in float32, one rounding).
"""

from __future__ import annotations

import torch

from deepserve.kernels import HAS_TRITON, INTERPRET, cdiv, next_pow2, require_triton, tl, triton
from deepserve.kernels.reference.sparse_attention import rope_interleaved

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ROPE_TILE_ELEMENTS = 4096          # elements of x per program (BLOCK_H x next_pow2(D))


def rope_supported(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> bool:
    """x [T, D] or [T, nH, D] float32 / float16 / bfloat16 with a unit last stride; cos, sin [P, R/2] float32
    contiguous tables with R <= D; positions [T] integer; all on one CUDA device (or the interpreter)."""
    if not HAS_TRITON or not (x.device.type == "cuda" or INTERPRET) or x.dtype not in _DTYPES:
        return False
    if x.dim() not in (2, 3) or x.stride(-1) != 1 or positions.shape != (x.shape[0],):
        return False
    if cos.dim() != 2 or cos.shape != sin.shape or cos.dtype != torch.float32 or sin.dtype != torch.float32:
        return False
    if not (cos.is_contiguous() and sin.is_contiguous()) or 2 * cos.shape[1] > x.shape[-1]:
        return False
    return all(t.device == x.device for t in (cos, sin, positions)) and not positions.dtype.is_floating_point


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, n_heads, head_dim, half, max_pos,
                 stride_xt, stride_xh, stride_ot, stride_oh, sign,
                 BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < n_heads
    ok = h_ok[:, None] & (d < head_dim)[None, :]
    src = x_ptr + t * stride_xt + h[:, None].to(tl.int64) * stride_xh
    x = tl.load(src + d[None, :], mask=ok, other=0.0).to(tl.float32)
    first = head_dim - 2 * half                              # the first rotated dim
    rel = d - first
    rotated = (rel >= 0) & (d < head_dim)
    pair = tl.where(rotated, rel // 2, 0)
    odd = (rel % 2) == 1
    partner = tl.where(odd, d - 1, d + 1)                    # the other element of the pair
    y = tl.load(src + partner[None, :], mask=ok & rotated[None, :], other=0.0).to(tl.float32)
    p = tl.load(pos_ptr + t)
    p = tl.minimum(tl.maximum(p, 0), max_pos - 1).to(tl.int64)
    c = tl.load(cos_ptr + p * half + pair, mask=rotated, other=1.0)
    s = tl.load(sin_ptr + p * half + pair, mask=rotated, other=0.0) * sign
    # even dim: x0 cos - x1 sin (x0 = x, x1 = y); odd dim: x0 sin + x1 cos (x0 = y, x1 = x)
    out = tl.where(odd[None, :], y * s[None, :] + x * c[None, :], x * c[None, :] - y * s[None, :])
    out = tl.where(rotated[None, :], out, x)
    dst = out_ptr + t * stride_ot + h[:, None].to(tl.int64) * stride_oh + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=ok)


def rope_at_positions(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                      inverse: bool = False) -> torch.Tensor:
    """The twin of `rope_interleaved(x, cos[positions], ±sin[positions])`: a new tensor like x (contiguous). Where
    `rope_supported` is False the twin runs."""
    if not rope_supported(x, cos, sin, positions):
        s = sin[positions]
        return rope_interleaved(x, cos[positions], -s if inverse else s)
    require_triton(x)
    view = x if x.dim() == 3 else x[:, None, :]
    T, nH, D = view.shape
    out = torch.empty(T, nH, D, dtype=x.dtype, device=x.device)
    if T and nH:
        block_d = next_pow2(D)
        block_h = max(1, min(next_pow2(nH), ROPE_TILE_ELEMENTS // block_d))
        _rope_kernel[(T, cdiv(nH, block_h))](
            view, cos, sin, positions, out, nH, D, cos.shape[1], cos.shape[0], view.stride(0), view.stride(1),
            out.stride(0), out.stride(1), -1.0 if inverse else 1.0, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4)
    return out if x.dim() == 3 else out[:, 0, :]


__all__ = ["rope_at_positions", "rope_supported"]
