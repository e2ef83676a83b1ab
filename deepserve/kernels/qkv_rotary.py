"""The attention's input at batch-1 decode in one launch: the qkv projection GEMV, the rotary embedding of q and k,
and the write of k and v into the paged cache (Llama/Qwen-style layers with a fused `qkv_proj`).

Unfused, a layer runs the qkv GEMV (one activation row, deepserve/kernels/gemv.py) and then `rotary_write_kv`
(deepserve/kernels/kv_write.py): two launches, the second a 2-3 us latency-bound kernel on 16 KB of data,
16 times per Llama-3.2-1B step. Here each GEMV program computes the two columns a NeoX rotation pairs, j and
j + D/2 of one head, so it can rotate them itself: a query head's pair goes to q_out, a key head's pair into the
cache slot, rotated, and a value head's pair into the cache as is.

Same arithmetic as the two launches: the GEMV's float32 sums (`gemv_rows`), rounded to the activation dtype (the
projection's output), then `rotate_heads`' float32 rotation, rounded to the activation dtype and stored in the
cache's. One token only (T = 1); a negative slot (a padded CUDA-graph row) writes no key or value.

Given the layer's input RMSNorm, a one-step GEMV (rows of up to 2048) normalises x itself (`one_step_rows`, the
RMSNorm kernel's arithmetic), so the layer's norm costs no launch either; longer rows get the norm kernel first.
"""

from __future__ import annotations

from typing import Optional

import torch

from deepserve.kernels import next_pow2, require_triton, tl, triton
from deepserve.kernels.gemv import (norm_eps, norm_ref, norm_weight_or, normed_gemv_rows, one_row_operands,
                                    prologue_norm)
from deepserve.kernels.kv_rounding import store_rounded
from deepserve.kernels.pdl import pdl_launch_args
from deepserve.kernels.rotary import half_width_caches


@triton.jit
def _pick(y, pair, which):
    """Element `which` of a 2-vector, as a scalar (exact: the other lane adds 0)."""
    return tl.sum(tl.where(pair == which, y, 0.0), 0)


@triton.jit
def rotation_inputs(pos_ptr, slot_ptr, cos_ptr, sin_ptr, stride_cos, j, HALF: tl.constexpr,
                    HALF_CACHE: tl.constexpr):
    """(slot, cos1, sin1, cos2, sin2) of the token: its cache slot and the float32 cos/sin of angle j at its
    position (rotate_heads' coefficients; half-width caches hold each column once)."""
    pos = tl.load(pos_ptr).to(tl.int64)
    cos1 = tl.load(cos_ptr + pos * stride_cos + j).to(tl.float32)
    sin1 = tl.load(sin_ptr + pos * stride_cos + j).to(tl.float32)
    if HALF_CACHE:
        cos2 = cos1
        sin2 = sin1
    else:
        cos2 = tl.load(cos_ptr + pos * stride_cos + HALF + j).to(tl.float32)
        sin2 = tl.load(sin_ptr + pos * stride_cos + HALF + j).to(tl.float32)
    return tl.load(slot_ptr).to(tl.int64), cos1, sin1, cos2, sin2


# positions and slot_mapping are views into the step's packed index buffer: not specialised on (see rotary.py).
@triton.jit(do_not_specialize=["pos_ptr", "slot_ptr"])
def _qkv_rotary_write_kernel(x_ptr, norm_ptr, w_ptr, bias_ptr, pos_ptr, slot_ptr, q_out_ptr, cache_ptr, cos_ptr,
                             sin_ptr, k_len, stride_wn, stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,
                             stride_cos, block_size, num_q_heads, num_kv_heads, eps,
                             HEAD_DIM: tl.constexpr, HALF_CACHE: tl.constexpr, HAS_BIAS: tl.constexpr,
                             NORM: tl.constexpr, BLOCK_K: tl.constexpr, ONE_STEP: tl.constexpr,
                             USE_PDL: tl.constexpr):
    HALF: tl.constexpr = HEAD_DIM // 2
    head = tl.program_id(0) // HALF          # q heads, then k heads, then v heads: qkv_proj's row order
    j = tl.program_id(0) % HALF
    pair = tl.arange(0, 2)
    rows = head * HEAD_DIM + j + pair * HALF
    y = normed_gemv_rows(x_ptr, norm_ptr, eps, w_ptr, rows, pair < 2, k_len, stride_wn, NORM, BLOCK_K, ONE_STEP,
                         USE_PDL)            # waits for x (PDL)
    # After the wait: loading the position, slot and cos/sin before it (they are ready) measured slower on an H200
    # at a 193-token context (0.826 vs 0.802 ms per step, run 4 of benchmarks/ab_b1_session6.json).
    slot, cos1, sin1, cos2, sin2 = rotation_inputs(pos_ptr, slot_ptr, cos_ptr, sin_ptr, stride_cos, j, HALF,
                                                   HALF_CACHE)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows).to(tl.float32)
    dtype = q_out_ptr.dtype.element_ty
    y = y.to(dtype).to(tl.float32)           # the projection's output rounding
    x1 = _pick(y, pair, 0)
    x2 = _pick(y, pair, 1)
    if head < num_q_heads + num_kv_heads:    # q or k: rotate (rotate_heads' arithmetic)
        o1 = (x1 * cos1 - x2 * sin1).to(dtype)
        o2 = (x2 * cos2 + x1 * sin2).to(dtype)
    else:                                    # v: as it is
        o1 = x1.to(dtype)
        o2 = x2.to(dtype)
    if head < num_q_heads:
        dst = q_out_ptr + head * HEAD_DIM + j
        tl.store(dst, o1)
        tl.store(dst + HALF, o2)
    else:
        kv = (head >= num_q_heads + num_kv_heads).to(tl.int64)    # 0: key, 1: value
        kv_head = head - num_q_heads - kv * num_kv_heads
        # Its own name: a pointer into the cache, whose dtype (fp8) may differ from q_out's.
        cache_dst = (cache_ptr + kv * stride_c_kv + (slot // block_size) * stride_c_block
                     + (slot % block_size) * stride_c_slot + kv_head * stride_c_head + j)
        store_rounded(cache_dst, o1, slot >= 0)        # into the cache's dtype (kernels/kv_rounding.py)
        store_rounded(cache_dst + HALF, o2, slot >= 0)


def qkv_rotary_write(x: torch.Tensor, w_qkv: torch.Tensor, bias: Optional[torch.Tensor], kv_cache: torch.Tensor,
                     slot_mapping: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                     sin_cache: torch.Tensor, num_heads: int, num_kv_heads: int, norm=None) -> torch.Tensor:
    """x [1, K], w_qkv [(H + 2 Hkv) * D, K] (q rows, then k, then v), bias or None; kv_cache [2, blocks, block_size,
    Hkv, D] -> q rotated at positions[0], [1, H, D]; k rotated and v written to the cache at slot_mapping[0]:
    `qkv_rotary_write_ref`, in one launch. With `norm` (an RMSNorm), of norm(x): the norm in the GEMV's prologue
    when one K step holds the row (`prologue_norm`), else the norm kernel first."""
    require_triton(x)
    x, w_qkv = one_row_operands(x, w_qkv)
    n, k = w_qkv.shape
    d = kv_cache.shape[-1]
    assert n == (num_heads + 2 * num_kv_heads) * d and d % 2 == 0, f"qkv rows {n} != (H + 2 Hkv) * {d}"
    assert kv_cache.stride(-1) == 1 and kv_cache.shape[0] == 2 and kv_cache.shape[3] == num_kv_heads
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous())
    half_cache = half_width_caches(d, cos_cache, sin_cache)
    q_out = torch.empty(1, num_heads, d, dtype=x.dtype, device=x.device)
    # Two rows (a rotation pair) per program; the H200 sweep's best 2-row tiling of a 3072 x 2048 qkv: K steps of
    # up to 2048, 2 warps (5.1 us vs 5.9 with steps of 512; benchmarks/tune_gemv_wide.json).
    block_k, warps = min(2048, max(16, next_pow2(k))), 2
    x, norm = prologue_norm(x, norm, block_k >= k)
    _qkv_rotary_write_kernel[(n // 2,)](
        x, norm_weight_or(norm, x), w_qkv, bias if bias is not None else x, positions, slot_mapping, q_out, kv_cache,
        cos_cache, sin_cache, k, w_qkv.stride(0), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        kv_cache.stride(3), cos_cache.stride(0), kv_cache.shape[2], num_heads, num_kv_heads, norm_eps(norm),
        HEAD_DIM=d, HALF_CACHE=half_cache, HAS_BIAS=bias is not None, NORM=norm is not None, BLOCK_K=block_k,
        ONE_STEP=block_k >= k, num_warps=warps, **pdl_launch_args(x))
    return q_out


def qkv_rotary_write_ref(x, w_qkv, bias, kv_cache, slot_mapping, positions, cos_cache, sin_cache, num_heads,
                         num_kv_heads, norm=None):
    """The two-step path: (the reference RMSNorm,) F.linear, then rotary_write_kv's PyTorch twin."""
    from deepserve.kernels.kv_write import rotary_write_kv_ref
    d = kv_cache.shape[-1]
    qkv = torch.nn.functional.linear(x if norm is None else norm_ref(x, norm), w_qkv, bias)
    q = qkv[:, :num_heads * d].view(1, num_heads, d)
    k = qkv[:, num_heads * d:(num_heads + num_kv_heads) * d].view(1, num_kv_heads, d)
    v = qkv[:, (num_heads + num_kv_heads) * d:].view(1, num_kv_heads, d)
    return rotary_write_kv_ref(kv_cache, q, k, v, slot_mapping, positions, cos_cache, sin_cache)


__all__ = ["qkv_rotary_write", "qkv_rotary_write_ref"]
