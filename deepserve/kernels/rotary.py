"""Rotary position embedding (NeoX rotate-half), applied to q and k in one launch: one program per token reads
its cos/sin row once and rotates every query and key head of that token.

Same arithmetic as deepserve/layers/rotary.py: float32 math on (x * cos + rotate_half(x) * sin), one rounding
to the activation dtype (a fused multiply-add may change the float32 value by one rounding, so outputs agree
to one rounding of the output dtype).

Two variants for DeepSeek's MLA (deepserve/layers/mla.py):
  interleaved  pairs (x[2j], x[2j+1]) turn by angle j and land at j and HALF + j: HF's de-interleave followed
               by the NeoX rotation, in one pass (the output is in the NeoX layout, as HF leaves it);
  half caches  cos/sin of width D/2 (one column per angle, as MLARotaryEmbedding keeps them) instead of the
               duplicated width-D caches of RotaryEmbedding: both halves read the same column.

The rotation (`cos_sin_row` + `rotate_heads`, with `rotary_constexprs` for its settings; `rotate_normed_heads` with
Qwen3's per-head RMSNorm first) is shared with the kernels that rotate and write the cache in one launch:
`rotary_write_kv` (deepserve/kernels/kv_write.py) and `rotary_write_latents` (deepserve/kernels/mla_decode.py).
"""

import torch

from deepserve.kernels import and_scalar, next_pow2, require_triton, tl, triton
from deepserve.kernels.kv_rounding import store_rounded
from deepserve.kernels.reference.rotary import rotate_at


@triton.jit
def cos_sin_row(cos_ptr, sin_ptr, pos, stride_cos,
                HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, HALF_CACHE: tl.constexpr):
    """float32 cos/sin of position `pos` for the two halves of a head (one column read twice from half-width
    caches), the angle index j and its mask: what `rotate_heads` takes."""
    j = tl.arange(0, BLOCK_HALF)
    jmask = j < HALF
    cos1 = tl.load(cos_ptr + pos * stride_cos + j, mask=jmask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + pos * stride_cos + j, mask=jmask, other=0.0).to(tl.float32)
    if HALF_CACHE:
        cos2 = cos1
        sin2 = sin1
    else:
        cos2 = tl.load(cos_ptr + pos * stride_cos + HALF + j, mask=jmask, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + pos * stride_cos + HALF + j, mask=jmask, other=0.0).to(tl.float32)
    return cos1, sin1, cos2, sin2, j, jmask


@triton.jit
def rotate_heads(x_row, o_row, stride_xh, stride_oh, num_heads, keep,
                 cos1, sin1, cos2, sin2, j, jmask,
                 HALF: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Rotate the `num_heads` heads of one token (x_row, o_row: that token's first head) and store them at o_row, if
    `keep`. Each value is rounded to x's dtype, then stored in o's (a KV cache may hold another dtype): the rotated
    tensor, then written, as the reference does it."""
    rotate_normed_heads(x_row, o_row, stride_xh, stride_oh, num_heads, keep, cos1, sin1, cos2, sin2, j, jmask,
                        x_row, 0.0, HALF, BLOCK_H, INTERLEAVED, False)


@triton.jit
def rotate_normed_heads(x_row, o_row, stride_xh, stride_oh, num_heads, keep,
                        cos1, sin1, cos2, sin2, j, jmask, norm_w_ptr, eps,
                        HALF: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, NORM: tl.constexpr):
    """`rotate_heads`, each head first RMS-normalised with the [2 * HALF] weight at norm_w_ptr when NORM (Qwen3's
    q_norm / k_norm before the rotation): kernels/norm.py's arithmetic (float32 statistics, the normalised value
    rounded to x's dtype, times the weight, rounded again), so the rotation sees what the two-launch path's does."""
    tl.static_assert(not (NORM and INTERLEAVED), "the norm's weight is read in the NeoX layout")
    dtype = x_row.dtype.element_ty
    if NORM:
        w1 = tl.load(norm_w_ptr + j, mask=jmask, other=0.0).to(tl.float32)
        w2 = tl.load(norm_w_ptr + HALF + j, mask=jmask, other=0.0).to(tl.float32)
    for h0 in range(0, num_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = (h < num_heads)[:, None] & jmask[None, :]
        row = x_row + h[:, None] * stride_xh
        if INTERLEAVED:
            x1 = tl.load(row + 2 * j[None, :], mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(row + 2 * j[None, :] + 1, mask=mask, other=0.0).to(tl.float32)
        else:
            x1 = tl.load(row + j[None, :], mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(row + HALF + j[None, :], mask=mask, other=0.0).to(tl.float32)
        if NORM:
            rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)
            x1 = ((x1 * rstd[:, None]).to(dtype).to(tl.float32) * w1[None, :]).to(dtype).to(tl.float32)
            x2 = ((x2 * rstd[:, None]).to(dtype).to(tl.float32) * w2[None, :]).to(dtype).to(tl.float32)
        o1 = x1 * cos1[None, :] - x2 * sin1[None, :]
        o2 = x2 * cos2[None, :] + x1 * sin2[None, :]
        dst = o_row + h[:, None] * stride_oh + j[None, :]
        store_rounded(dst, o1.to(dtype), and_scalar(mask, keep))      # into a cache's dtype (kernels/kv_rounding.py)
        store_rounded(dst + HALF, o2.to(dtype), and_scalar(mask, keep))


# positions is a view into the step's packed index buffer: its 16-byte alignment changes with the step's token
# count, and specialising on it would compile a second variant mid-serving.
@triton.jit(do_not_specialize=["pos_ptr"])
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
                   stride_cos, num_q_heads, num_k_heads,
                   HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                   INTERLEAVED: tl.constexpr, HALF_CACHE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cos1, sin1, cos2, sin2, j, jmask = cos_sin_row(cos_ptr, sin_ptr, pos, stride_cos, HALF, BLOCK_HALF, HALF_CACHE)
    rotate_heads(q_ptr + t * stride_qt, qo_ptr + t * stride_qot, stride_qh, stride_qoh, num_q_heads, True,
                 cos1, sin1, cos2, sin2, j, jmask, HALF, BLOCK_H, INTERLEAVED)
    rotate_heads(k_ptr + t * stride_kt, ko_ptr + t * stride_kot, stride_kh, stride_koh, num_k_heads, True,
                 cos1, sin1, cos2, sin2, j, jmask, HALF, BLOCK_H, INTERLEAVED)


def half_width_caches(d: int, cos_cache: torch.Tensor, sin_cache: torch.Tensor) -> bool:
    """True for half-width caches ([max_pos, D/2]), False for full-width ones ([max_pos, D])."""
    assert d % 2 == 0 and cos_cache.shape[-1] in (d, d // 2) and cos_cache.stride(-1) == 1
    assert sin_cache.shape == cos_cache.shape and sin_cache.stride() == cos_cache.stride()
    return cos_cache.shape[-1] == d // 2


def rotary_constexprs(head_dim: int, max_heads: int, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                      interleaved: bool) -> dict:
    """The compile-time settings of `cos_sin_row` + `rotate_heads` for heads of `head_dim` with these caches, the
    largest rotated tensor having `max_heads` heads (a program rotates up to BLOCK_H heads at a time)."""
    half = head_dim // 2
    block_half = next_pow2(half)
    return dict(HALF=half, BLOCK_HALF=block_half, BLOCK_H=max(1, min(next_pow2(max_heads), 4096 // block_half)),
                INTERLEAVED=interleaved, HALF_CACHE=half_width_caches(head_dim, cos_cache, sin_cache))


def _launch(positions, q, k, q_out, k_out, num_k_heads, cos_cache, sin_cache, interleaved: bool) -> None:
    t, h, d = q.shape
    if t == 0:
        return
    _rotary_kernel[(t,)](
        positions, q, k, q_out, k_out, cos_cache, sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos_cache.stride(0), h, num_k_heads, **rotary_constexprs(d, max(h, num_k_heads), cos_cache, sin_cache,
                                                                 interleaved), num_warps=4)


def apply_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_cache: torch.Tensor,
                 sin_cache: torch.Tensor, inplace: bool = False, interleaved: bool = False):
    """q: [T, H, D], k: [T, Hkv, D] (any row/head strides), positions: [T]; cos/sin caches: [max_pos, D] or
    [max_pos, D/2]. `interleaved`: rotate pairs (2j, 2j+1) and write them at (j, D/2 + j) (DeepSeek's MLA).
    Returns (q_rot, k_rot): new contiguous tensors, or q and k themselves when `inplace`."""
    require_triton(q)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    q_out = q if inplace else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = k if inplace else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    _launch(positions, q, k, q_out, k_out, k.shape[1], cos_cache, sin_cache, interleaved)
    return q_out, k_out


def rotate(positions: torch.Tensor, x: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
           inplace: bool = False, interleaved: bool = False) -> torch.Tensor:
    """One tensor of heads ([T, heads, D], e.g. q and k side by side): the rotated copy (or x, rotated in place)."""
    require_triton(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = x if inplace else torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(positions, x, x, out, out, 0, cos_cache, sin_cache, interleaved)
    return out


def rotate_ref(positions, x, cos_cache, sin_cache, inplace: bool = False):
    """The PyTorch twin of `rotate` (what RotaryEmbedding.rotate computes)."""
    out = rotate_at(positions, x, cos_cache, sin_cache)
    return x.copy_(out) if inplace else out


def apply_rotary_ref(positions, q, k, cos_cache, sin_cache, inplace: bool = False):
    """The PyTorch twin (what RotaryEmbedding.forward computes)."""
    q_rot, k_rot = rotate_at(positions, q, cos_cache, sin_cache), rotate_at(positions, k, cos_cache, sin_cache)
    if inplace:
        q.copy_(q_rot)
        k.copy_(k_rot)
        return q, k
    return q_rot, k_rot


def rotary_forward(rope, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, inplace: bool = False):
    """Drop-in for `RotaryEmbedding.forward` (reads its cos/sin caches)."""
    return apply_rotary(positions, q, k, rope.cos_cache, rope.sin_cache, inplace=inplace)


def rotary_rotate(rope, positions: torch.Tensor, x: torch.Tensor, inplace: bool = False):
    """Drop-in for `RotaryEmbedding.rotate`."""
    return rotate(positions, x, rope.cos_cache, rope.sin_cache, inplace=inplace)


__all__ = ["apply_rotary", "apply_rotary_ref", "rotate", "rotate_ref", "rotary_forward", "rotary_rotate", "cos_sin_row",
           "rotate_heads", "rotary_constexprs"]
