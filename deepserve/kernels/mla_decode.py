"""Multi-head latent attention decode over the paged latent cache (DeepSeek-V2/V3), in latent space.

Cache of one layer: [num_blocks, block_size, R + P] per token: the compressed latent c (R = kv_lora_rank) then
the shared RoPE key k_pe (P = qk_rope_head_dim); see deepserve/layers/mla.py. The cache write is a kernel of its
own, or fused with the rotary embedding of q_pe and k_pe (`rotary_write_latents`: one launch instead of two).
With W_UK absorbed into the query (q_lat = q_nope W_UK, done outside), head h's score of token j is
q_lat[h] . c[j] + q_pe[h] . k_pe[j] and its output is the probability-weighted sum of the latents c[j]; W_UV is
applied outside.

Every head of a sequence reads the same latents, so one program takes a tile of BLOCK_H heads: each cache tile
is loaded once and used for all of them, both as keys and as values (MQA with a 576-wide key and a 512-wide
value that is the key's prefix). Long contexts with few sequences are split over the context (split-K); a
reduce kernel merges the splits by their log-sum-exp, as the paged decode kernel does, reading only the splits a
sequence uses (a CUDA graph's grid is sized for the longest context; the programs of empty splits exit at once).

Numerics: scores, softmax statistics and the accumulator in float32; probabilities cast to the cache dtype for
the P @ C product (flash-attention style); the output rounded once.
"""

from __future__ import annotations

from typing import Optional

import torch

from deepserve import envs
from deepserve.kernels import and_scalar, cdiv, next_pow2, num_sms, require_triton, tl, triton
from deepserve.kernels import mla_decode_wgmma
from deepserve.kernels.kv_rounding import for_products, store_rounded, widen_values
from deepserve.kernels.norm import rms_normed
from deepserve.kernels.kv_write import copy_heads, rotary_write_prologue
from deepserve.kernels.paged_attention import (active_splits, active_splits_ref, merge_splits_ref, split_bounds,
                                               tile_blocks)
from deepserve.kernels.pdl import (EARLY_INPUTS, pdl_launch_args, pdl_launch_dependents, pdl_wait,
                                  pdl_wait_after_inputs, pdl_wait_for_inputs)
from deepserve.kernels.reference import attention as reference_attention
from deepserve.kernels.reference.norm import rms_norm
from deepserve.kernels.rotary import rotary_constexprs, rotate_heads

_LOG2E = 1.4426950408889634
MLA_BLOCK_N = 32         # cached tokens per inner step
MLA_BLOCK_H = 16         # heads per program (tl.dot needs >= 16 rows; padded heads are masked)
_MIN_PARTITION = 48      # tokens (54 KiB of bf16 latents): shorter splits cost more in the reduce than they gain
_MAX_SPLITS = 128
# Split rows the reduce loads at once, at most: [16, 512] float32 is 64 registers a thread at 4 warps. Each chunk
# is a dependent round trip to L2, so fewer, larger chunks shorten the reduce: on an H200 (V2-Lite, decode +
# reduce, mla_reduce_chunk_ab_h200.json) 16 rows against 4 took batch 8 from 14.71 to 13.78 us at 1k context and
# 27.53 to 26.62 at 4k, batch 16 from 18.69 to 18.13; at batch 64 (4 splits) a 16-row tile of 4 live rows lost
# 0.6 us, so a launch's chunk is its split count's power of two up to this, 4 at least.
REDUCE_CHUNK_S = 16


def parse_tiles(text: str) -> Optional[tuple[int, int, int, Optional[int]]]:
    """'KEYSxWARPSxSTAGES[rREGISTERS]' (DEEPSERVE_MLA_DECODE_TILES) -> (keys per tile, warps, stages, register cap or
    None); '' -> None. Keys: a power of two of at least 16 (a tl.dot's side); warps: 1, 2, 4 or 8; stages: 1 to 6;
    the cap (Triton's maxnreg: fewer registers, more programs per SM, maybe spills): 32 to 255."""
    if not text:
        return None
    tiles, capped, cap = text.lower().partition("r")
    try:
        block_n, warps, stages = (int(p) for p in tiles.split("x"))
        maxnreg = int(cap) if capped else None
    except ValueError:
        raise ValueError(f"MLA decode tiles {text!r} (DEEPSERVE_MLA_DECODE_TILES): expected KEYSxWARPSxSTAGES or "
                         "KEYSxWARPSxSTAGESrREGISTERS, e.g. 16x4x3 or 32x4x2r168") from None
    if (block_n < 16 or block_n & (block_n - 1) or warps not in (1, 2, 4, 8) or not 1 <= stages <= 6
            or (maxnreg is not None and not 32 <= maxnreg <= 255)):
        raise ValueError(f"MLA decode tiles {text!r} (DEEPSERVE_MLA_DECODE_TILES): keys a power of two >= 16, "
                         "warps 1/2/4/8, stages 1-6, registers 32-255")
    return block_n, warps, stages, maxnreg


FORCED_TILES = parse_tiles(envs.DEEPSERVE_MLA_DECODE_TILES)
PROGRAMS_PER_SM = envs.DEEPSERVE_MLA_PROGRAMS_PER_SM
if PROGRAMS_PER_SM < 1:
    raise ValueError(f"MLA decode programs an SM (DEEPSERVE_MLA_PROGRAMS_PER_SM): {PROGRAMS_PER_SM}, expected >= 1")
DEFAULT_TILES = (MLA_BLOCK_N, 4, 3, None)


def launch_tiles(block_n: Optional[int], num_warps: Optional[int], num_stages: Optional[int],
                 maxnreg: Optional[int] = None) -> tuple:
    """A launch's (keys per tile, warps, stages, register cap or None): the caller's where given, else
    DEEPSERVE_MLA_DECODE_TILES', else the default."""
    base = FORCED_TILES or DEFAULT_TILES
    return (block_n or base[0], num_warps or base[1], num_stages or base[2], maxnreg or base[3])


@triton.jit
def _write_latent_kernel(latent_ptr, k_pe_ptr, cache_ptr, slot_ptr, stride_lt, stride_pt,
                         stride_c_block, stride_c_slot, block_size,
                         RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """cache[slot] = [latent | k_pe] for one row; a negative slot (a CUDA-graph padding row) writes nothing."""
    pdl_wait(USE_PDL)              # first (kernels/pdl.py): reads this step's data, writes the cache/outputs
    pdl_launch_dependents(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK)
    keep = slot >= 0
    in_latent = d < RANK
    in_rope = (d >= RANK) & (d < RANK + ROPE)
    value = tl.load(latent_ptr + t * stride_lt + d, mask=and_scalar(in_latent, keep), other=0.0)
    rope = tl.load(k_pe_ptr + t * stride_pt + (d - RANK), mask=and_scalar(in_rope, keep), other=0.0)
    value = tl.where(in_rope, rope, value)
    dst = cache_ptr + (slot // block_size) * stride_c_block + (slot % block_size) * stride_c_slot + d
    store_rounded(dst, value, and_scalar(d < RANK + ROPE, keep))     # into the cache's dtype (kernels/kv_rounding.py)


def write_latents(kv_cache: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, slot_mapping: torch.Tensor):
    """kv_cache[slot] = [latent | k_pe] per row (latent [T, R], k_pe [T, P], unit last strides), rows with a
    negative slot skipped: the reference's write, safe for padded CUDA-graph batches."""
    require_triton(latent)
    t, rank = latent.shape
    rope = k_pe.shape[-1]
    if t == 0:
        return
    if latent.stride(-1) != 1:
        latent = latent.contiguous()
    if k_pe.stride(-1) != 1:
        k_pe = k_pe.contiguous()
    assert kv_cache.shape[-1] == rank + rope and kv_cache.stride(-1) == 1
    _write_latent_kernel[(t,)](latent, k_pe, kv_cache, slot_mapping, latent.stride(0), k_pe.stride(0),
                               kv_cache.stride(0), kv_cache.stride(1), kv_cache.shape[1],
                               RANK=rank, ROPE=rope, BLOCK=next_pow2(rank + rope), num_warps=4,
                               **pdl_launch_args(latent))


def write_latents_ref(kv_cache, latent, k_pe, slot_mapping):
    """The reference backend's write (TorchMLA): every slot must be valid."""
    reference_attention.write_latents(kv_cache, latent, k_pe, slot_mapping)


# positions and slot_mapping are views into the step's packed index buffer: not specialised on (see rotary.py).
@triton.jit(do_not_specialize=["pos_ptr", "slot_ptr"])
def _rotary_write_latent_kernel(pos_ptr, slot_ptr, q_pe_ptr, latent_ptr, k_pe_ptr, q_out_ptr, cache_ptr, cos_ptr,
                                sin_ptr, norm_w_ptr, eps, stride_qt, stride_qh, stride_qot, stride_qoh, stride_lt,
                                stride_pt, stride_c_block, stride_c_slot, stride_cos, block_size, num_heads,
                                RANK: tl.constexpr, BLOCK_R: tl.constexpr, HALF: tl.constexpr,
                                BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr,
                                HALF_CACHE: tl.constexpr, HAS_NORM: tl.constexpr, NORM_OUT_FP32: tl.constexpr,
                                INPUTS_READY: tl.constexpr, USE_PDL: tl.constexpr):
    """One token: q_pe's heads rotated into q_out (padding rows too), the latent (RMS-normed first with HAS_NORM)
    and k_pe rotated straight into the cache slot, [latent | k_pe]."""
    t, dst, keep, cos1, sin1, cos2, sin2, j, jmask = rotary_write_prologue(
        pos_ptr, slot_ptr, cache_ptr, cos_ptr, sin_ptr, stride_c_block, stride_c_slot, stride_cos, block_size,
        HALF, BLOCK_HALF, HALF_CACHE, INPUTS_READY, USE_PDL)
    rotate_heads(q_pe_ptr + t * stride_qt, q_out_ptr + t * stride_qot, stride_qh, stride_qoh, num_heads, True,
                 cos1, sin1, cos2, sin2, j, jmask, HALF, BLOCK_H, INTERLEAVED)
    rotate_heads(k_pe_ptr + t * stride_pt, dst + RANK, 0, 0, 1, keep,
                 cos1, sin1, cos2, sin2, j, jmask, HALF, BLOCK_H, INTERLEAVED)
    if HAS_NORM:
        r = tl.arange(0, BLOCK_R)
        r_ok = r < RANK
        x = tl.load(latent_ptr + t * stride_lt + r, mask=r_ok, other=0.0)
        store_rounded(dst + r, rms_normed(x, norm_w_ptr, r, r_ok, RANK, eps, NORM_OUT_FP32), and_scalar(r_ok, keep))
    else:
        copy_heads(latent_ptr + t * stride_lt, 0, dst, 0, 1, keep, RANK, BLOCK_R)


def rotary_write_latents(kv_cache: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                         slot_mapping: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                         sin_cache: torch.Tensor, interleaved: bool, norm_weight: Optional[torch.Tensor] = None,
                         norm_eps: float = 0.0, inputs_ready: bool = False) -> torch.Tensor:
    """The rotary embedding of q_pe [T, H, P] and k_pe [T, P] at `positions` (MLARotaryEmbedding's: `interleaved`
    pairs or NeoX halves, its half-width cos/sin caches) and the cache write of [latent | rotated k_pe] (latent
    [T, R]), in one launch: `apply_rotary(..., interleaved=interleaved)` then `write_latents`, rows with a negative
    slot writing nothing. Any row/head strides, unit last strides. Returns the rotated q_pe, a new contiguous
    tensor; the rotated k_pe lives only in the cache. With `norm_weight`, the latent is the kv_a projection's raw
    output and is cached as `rms_norm(latent, norm_weight, norm_eps)` (kernels/norm.py's arithmetic): the
    kv_a_layernorm launch folds into this one. `inputs_ready` as in `rotary_write_kv`."""
    require_triton(q_pe)
    t, heads, rope = q_pe.shape
    rank = latent.shape[-1]
    q_out = torch.empty(q_pe.shape, dtype=q_pe.dtype, device=q_pe.device)
    if t == 0:
        return q_out
    q_pe, latent, k_pe = (x if x.stride(-1) == 1 else x.contiguous() for x in (q_pe, latent, k_pe))
    assert kv_cache.shape[-1] == rank + rope and kv_cache.stride(-1) == 1 and k_pe.shape == (t, rope)
    if norm_weight is not None:
        assert norm_weight.shape == (rank,) and norm_weight.is_contiguous()
    _rotary_write_latent_kernel[(t,)](
        positions, slot_mapping, q_pe, latent, k_pe, q_out, kv_cache, cos_cache, sin_cache,
        norm_weight if norm_weight is not None else latent, float(norm_eps), q_pe.stride(0), q_pe.stride(1),
        q_out.stride(0), q_out.stride(1), latent.stride(0), k_pe.stride(0),
        kv_cache.stride(0), kv_cache.stride(1), cos_cache.stride(0), kv_cache.shape[1], heads,
        RANK=rank, BLOCK_R=next_pow2(rank), **rotary_constexprs(rope, heads, cos_cache, sin_cache, interleaved),
        HAS_NORM=norm_weight is not None,
        NORM_OUT_FP32=norm_weight is not None and torch.promote_types(norm_weight.dtype, latent.dtype) == torch.float32,
        INPUTS_READY=inputs_ready and EARLY_INPUTS, num_warps=4, **pdl_launch_args(q_pe))
    return q_out


def rotary_write_latents_ref(kv_cache, q_pe, latent, k_pe, slot_mapping, positions, rotary, norm_weight=None,
                             norm_eps=0.0):
    """The PyTorch twin, given the MLARotaryEmbedding whose caches the kernel reads: the reference norm of the latent
    (with norm_weight), its reference rotation, then the reference write of the rows with a valid slot."""
    if norm_weight is not None:
        latent = rms_norm(latent, norm_weight, norm_eps)
    q_rot, k_rot = rotary.reference(positions, q_pe), rotary.reference(positions, k_pe.unsqueeze(1)).squeeze(1)
    keep = slot_mapping >= 0
    write_latents_ref(kv_cache, latent[keep], k_rot[keep], slot_mapping[keep])
    return q_rot


# Per-step arguments (block-table width, split layout) are not specialised on, so that a change between
# "divisible by 16" and not does not compile a new variant in the middle of serving.
_PER_STEP_ARGS = ["stride_po_b", "stride_po_h", "stride_pl_b", "stride_pl_h"]


@triton.jit
def load_columns(row_ptrs, first: tl.constexpr, cols, rows_ok, width):
    """Columns first + cols of the rows at row_ptrs ([rows, 1] pointers): 0 at and past `width` or on masked rows.
    A column chunk of a wide row (also kernels/sparse_attention.py's)."""
    return tl.load(row_ptrs + first + cols[None, :], mask=rows_ok[:, None] & (first + cols < width)[None, :],
                   other=0.0)


@triton.jit
def store_columns(row_ptrs, first: tl.constexpr, cols, rows_ok, value, width):
    """`load_columns`'s store: value [rows, chunk] rounded to the rows' dtype."""
    tl.store(row_ptrs + first + cols[None, :], value.to(row_ptrs.dtype.element_ty),
             mask=rows_ok[:, None] & (first + cols < width)[None, :])


@triton.jit(do_not_specialize=_PER_STEP_ARGS + ["stride_bt"])
def _mla_decode_kernel(q_lat_ptr, q_pe_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr,
                       out_ptr, part_out_ptr, part_lse_ptr,
                       qk_scale,
                       stride_qlb, stride_qlh, stride_qpb, stride_qph,
                       stride_c_block, stride_c_slot, stride_bt, stride_ob, stride_oh,
                       stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h,
                       num_heads, block_size,
                       RANK: tl.constexpr, ROPE: tl.constexpr, CHUNK: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                       PRECISION: tl.constexpr, INPUTS_READY: tl.constexpr, USE_PDL: tl.constexpr):
    """One (sequence, head tile, split). The latent is handled as four column chunks of CHUNK (a quarter of its
    padded width): the score is five products (four chunks and the RoPE part) summed, and the output four
    accumulators. Why: with one [BLOCK_H, 576] x [576, BLOCK_N] product every warp ran one chain of 36 dependent
    MMAs per tile (the warps split BLOCK_N), and that chain's latency, not memory, bounded the kernel (Nsight
    Compute's top stall, session 20: decode_attention_ncu_b8_h200.json); five independent chains of at most 8
    can interleave."""
    b = tl.program_id(0).to(tl.int64)
    head_tile = tl.program_id(1)
    split = tl.program_id(2)
    table = block_tables_ptr + b * stride_bt
    # With INPUTS_READY (the step's inputs were in place before its first kernel) the length and the first tile's
    # block ids load while the previous kernel finishes; else after the wait (kernels/pdl.py, rule 1).
    pdl_wait_for_inputs(INPUTS_READY, USE_PDL)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    start, end = split_bounds(seq_len, split, SPLIT, BLOCK_N)
    blk = tile_blocks(table, start + tl.arange(0, BLOCK_N), end, block_size)
    pdl_wait_after_inputs(INPUTS_READY, USE_PDL)
    if SPLIT:
        if start >= end:        # an empty split: the reduce does not read it, so nothing to load or store
            return

    heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    c = tl.arange(0, CHUNK)
    p = tl.arange(0, BLOCK_P)
    p_ok = p < ROPE
    q_rows = q_lat_ptr + b * stride_qlb + heads[:, None] * stride_qlh
    q0 = for_products(load_columns(q_rows, 0 * CHUNK, c, h_ok, RANK), cache_ptr)
    q1 = for_products(load_columns(q_rows, 1 * CHUNK, c, h_ok, RANK), cache_ptr)
    q2 = for_products(load_columns(q_rows, 2 * CHUNK, c, h_ok, RANK), cache_ptr)
    q3 = for_products(load_columns(q_rows, 3 * CHUNK, c, h_ok, RANK), cache_ptr)
    q_pe = for_products(tl.load(q_pe_ptr + b * stride_qpb + heads[:, None] * stride_qph + p[None, :],
                                mask=h_ok[:, None] & p_ok[None, :], other=0.0), cache_ptr)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, CHUNK], tl.float32)
    acc1 = tl.zeros([BLOCK_H, CHUNK], tl.float32)
    acc2 = tl.zeros([BLOCK_H, CHUNK], tl.float32)
    acc3 = tl.zeros([BLOCK_H, CHUNK], tl.float32)
    # Every tile holds at least one real token (the loop stops at `end`), so m_i is finite after the first.
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        t_ok = tok < end
        slot = (cache_ptr + blk * stride_c_block + (tok % block_size).to(tl.int64) * stride_c_slot)[:, None]
        blk = tile_blocks(table, tok + BLOCK_N, end, block_size)     # the next tile's, a round trip ahead
        # An fp8 cache's codes widen to q's dtype here (a no-op for a cache of q's dtype); they are values too. The
        # score products widening the staged 8-bit codes instead (half the shared-memory bytes for the keys) was 27%
        # slower at V2-Lite batch 256 on an H100 (session 35, mla_fp8_keys_kernels_h100_s35.json).
        c0 = widen_values(load_columns(slot, 0 * CHUNK, c, t_ok, RANK), q0.dtype)
        c1 = widen_values(load_columns(slot, 1 * CHUNK, c, t_ok, RANK), q0.dtype)
        c2 = widen_values(load_columns(slot, 2 * CHUNK, c, t_ok, RANK), q0.dtype)
        c3 = widen_values(load_columns(slot, 3 * CHUNK, c, t_ok, RANK), q0.dtype)
        k_pe = tl.load(slot + RANK + p[None, :], mask=t_ok[:, None] & p_ok[None, :], other=0.0).to(q_pe.dtype)
        s = ((tl.dot(q0, tl.trans(c0), input_precision=PRECISION) + tl.dot(q1, tl.trans(c1), input_precision=PRECISION))
             + (tl.dot(q2, tl.trans(c2), input_precision=PRECISION)
                + tl.dot(q3, tl.trans(c3), input_precision=PRECISION))
             + tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION))                       # [BLOCK_H, BLOCK_N]
        s = tl.where(t_ok[None, :], s * qk_scale, float("-inf"))               # log2 domain
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        prob = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, 1)
        # The latent chunks double as the value tile: no second load.
        prob = prob.to(c0.dtype)
        acc0 = tl.dot(prob, c0, acc0 * alpha[:, None], input_precision=PRECISION)
        acc1 = tl.dot(prob, c1, acc1 * alpha[:, None], input_precision=PRECISION)
        acc2 = tl.dot(prob, c2, acc2 * alpha[:, None], input_precision=PRECISION)
        acc3 = tl.dot(prob, c3, acc3 * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    # SPLIT: this (non-empty) split's normalised output (float32) and log2-sum-exp; else the output, rounded once.
    if SPLIT:
        o_rows = part_out_ptr + b * stride_po_b + heads[:, None] * stride_po_h + split * stride_po_s
        tl.store(part_lse_ptr + b * stride_pl_b + heads * stride_pl_h + split, m_i + tl.math.log2(l_i), mask=h_ok)
    else:
        o_rows = out_ptr + b * stride_ob + heads[:, None] * stride_oh
    store_columns(o_rows, 0 * CHUNK, c, h_ok, acc0 / l_i[:, None], RANK)
    store_columns(o_rows, 1 * CHUNK, c, h_ok, acc1 / l_i[:, None], RANK)
    store_columns(o_rows, 2 * CHUNK, c, h_ok, acc2 / l_i[:, None], RANK)
    store_columns(o_rows, 3 * CHUNK, c, h_ok, acc3 / l_i[:, None], RANK)


@triton.jit(do_not_specialize=_PER_STEP_ARGS + ["num_splits"])
def _mla_reduce_kernel(part_out_ptr, part_lse_ptr, seq_lens_ptr, out_ptr,
                       stride_po_b, stride_po_h, stride_po_s, stride_pl_b, stride_pl_h, stride_ob, stride_oh,
                       num_splits,
                       RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
                       CHUNK_S: tl.constexpr, INPUTS_READY: tl.constexpr, USE_PDL: tl.constexpr):
    """Merge the splits of one (sequence, head): weights 2^(lse_s - max lse), CHUNK_S split rows per load (a
    [splits, 512] float32 tile would not fit in registers), over this sequence's active splits only: the empty
    ones (most of a CUDA graph's grid at short contexts) weigh 0 and their programs store nothing."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    pdl_wait_for_inputs(INPUTS_READY, USE_PDL)    # the previous kernel (the decode's) writes no seq_lens
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    pdl_wait_after_inputs(INPUTS_READY, USE_PDL)
    used = active_splits(seq_len, num_splits, BLOCK_N)
    s = tl.arange(0, BLOCK_S)
    lse_ptr = part_lse_ptr + b * stride_pl_b + h * stride_pl_h
    lse = tl.load(lse_ptr + s, mask=s < used, other=float("-inf"))
    lse_max = tl.max(lse, 0)                                  # finite: split 0 always holds token 0
    total = tl.sum(tl.math.exp2(lse - lse_max), 0)
    r = tl.arange(0, BLOCK_R)
    r_ok = r < RANK
    c = tl.arange(0, CHUNK_S)
    acc = tl.zeros([BLOCK_R], tl.float32)
    for s0 in range(0, used, CHUNK_S):
        c_ok = s0 + c < used
        w = tl.math.exp2(tl.load(lse_ptr + s0 + c, mask=c_ok, other=float("-inf")) - lse_max)    # 0 past `used`
        o = tl.load(part_out_ptr + b * stride_po_b + h * stride_po_h + (s0 + c)[:, None] * stride_po_s + r[None, :],
                    mask=c_ok[:, None] & r_ok[None, :], other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + r, (acc / total).to(out_ptr.dtype.element_ty), mask=r_ok)


def mla_num_splits(batch: int, num_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Split the context so that (sequences x head tiles x splits) programs come to about, never above, two per
    SM (PROGRAMS_PER_SM): measured best on an H200 for 16 heads at batch 8 to 256 and contexts 1k and 4k
    (benchmarks/tune_decode_attention.py, tune_decode_attention.json: one more split than that, e.g. 5 instead of
    4 at batch 64, cost up to 30%; at batch 256 one split beat two by 15%)."""
    programs = max(1, batch * cdiv(num_heads, MLA_BLOCK_H))
    target = PROGRAMS_PER_SM * num_sms(device)
    if programs >= target or max_seq_len <= 2 * _MIN_PARTITION:
        return 1
    return max(1, min(target // programs, cdiv(max_seq_len, _MIN_PARTITION), _MAX_SPLITS))


def mla_decode(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, out: Optional[torch.Tensor] = None,
               max_seq_len: Optional[int] = None, num_splits: Optional[int] = None, block_n: Optional[int] = None,
               num_warps: Optional[int] = None, num_stages: Optional[int] = None, maxnreg: Optional[int] = None,
               inputs_ready: bool = False) -> torch.Tensor:
    """One query token per sequence b (row b) over its paged latents.

    q_lat: [B, H, R] (q_nope with W_UK absorbed), q_pe: [B, H, P] (any batch/head strides, unit last stride);
    kv_cache: [num_blocks, block_size, R + P]; block_tables [B, max_blocks]; seq_lens [B] (>= 1, this step's
    latent already written) -> [B, H, R] attention-weighted latents (in `out` if given, else q_lat's dtype).
    `max_seq_len` (host int) sizes the split without a device sync; `num_splits` forces it; `block_n`,
    `num_warps`, `num_stages`, `maxnreg` (a register cap) are the tile and launch settings (tuning; None:
    `launch_tiles`). `inputs_ready`: seq_lens and block_tables were in place before the kernel launched just before
    this call (the backend's per-step metadata), so they may be read before the PDL wait.
    """
    require_triton(q_lat)
    block_n, num_warps, num_stages, maxnreg = launch_tiles(block_n, num_warps, num_stages, maxnreg)
    bsz, heads, rank = q_lat.shape
    rope = q_pe.shape[-1]
    assert kv_cache.shape[-1] == rank + rope and kv_cache.stride(-1) == 1
    if q_lat.stride(-1) != 1:
        q_lat = q_lat.contiguous()
    if q_pe.stride(-1) != 1:
        q_pe = q_pe.contiguous()
    if out is None:
        out = torch.empty(bsz, heads, rank, dtype=q_lat.dtype, device=q_lat.device)
    if bsz == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item())
    if num_splits is None:
        num_splits = mla_num_splits(bsz, heads, max_seq_len, q_lat.device)
    # DEEPSERVE_MLA_WGMMA (the default): kernels/mla_decode_wgmma.py's kernel where it applies, the same splits in its
    # 64-key tiles. It computes as this file's kernel does with f16 products, so only where those are chosen.
    wgmma = (envs.DEEPSERVE_MLA_WGMMA and envs.DEEPSERVE_FP8_PRODUCTS == "f16"
             and mla_decode_wgmma.wgmma_supported(q_lat, kv_cache))
    if wgmma:
        block_n = mla_decode_wgmma.TOKENS
    partition = cdiv(cdiv(max_seq_len, num_splits), block_n) * block_n
    num_splits = max(1, cdiv(max_seq_len, partition))
    split = num_splits > 1
    if split:
        part_out = torch.empty(bsz, heads, num_splits, rank, dtype=torch.float32, device=q_lat.device)
        part_lse = torch.empty(bsz, heads, num_splits, dtype=torch.float32, device=q_lat.device)
        po = (part_out.stride(0), part_out.stride(1), part_out.stride(2))
        pl = (part_lse.stride(0), part_lse.stride(1))
    else:
        part_out = part_lse = out      # unused
        po, pl = (0, 0, 0), (0, 0)
    chunk = max(16, next_pow2(rank) // 4)       # four chunks cover the rank (16 at least: a tl.dot's K)
    # 32-token tiles, 4 warps, 3 stages: the best or within 5% of it on an H200 at batch 8-128, 1k and 4k, among
    # 16/32/64-token tiles x 4/8 warps x 2/3 stages (mla_decode_chunks_ab_h200.json). At batch 256 (one split)
    # 64-token tiles on 2 stages took the kernel alone from 101 to 87 us, but V2-Lite's decode step from 12.10-12.24
    # to 12.28-12.31 ms (two A/B pairs in one run, session23_steps_ab_h200.json): not taken.
    precision = "ieee" if q_lat.dtype == torch.float32 else "tf32"      # fp32 inputs: no TF32 rounding
    if wgmma:
        mla_decode_wgmma.launch_mla_decode_wgmma(q_lat, q_pe, kv_cache, block_tables, seq_lens, out, part_out,
                                                 part_lse, scale * _LOG2E, num_splits,
                                                 copy_async=envs.DEEPSERVE_MLA_WGMMA_ASYNC,
                                                 reg_scores=envs.DEEPSERVE_MLA_WGMMA_REG_SCORES)
    else:
        _mla_decode_kernel[(bsz, cdiv(heads, MLA_BLOCK_H), num_splits)](
            q_lat, q_pe, kv_cache, block_tables, seq_lens, out, part_out, part_lse,
            scale * _LOG2E,
            q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
            *po, *pl, heads, kv_cache.shape[1],
            RANK=rank, ROPE=rope, CHUNK=chunk, BLOCK_P=max(16, next_pow2(rope)),
            BLOCK_H=MLA_BLOCK_H, BLOCK_N=block_n, SPLIT=split, PRECISION=precision,
            INPUTS_READY=inputs_ready and EARLY_INPUTS, num_warps=num_warps, num_stages=num_stages,
            **({"maxnreg": maxnreg} if maxnreg else {}), **pdl_launch_args(q_lat))
    if split:
        # The decode kernel, the reduce's predecessor, does not write seq_lens: ready for it.
        mla_reduce(part_out, part_lse, seq_lens, out, block_n, inputs_ready=EARLY_INPUTS)
    return out


def mla_reduce(part_out: torch.Tensor, part_lse: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
               block_n: int = MLA_BLOCK_N, inputs_ready: bool = False, chunk_s: Optional[int] = None) -> torch.Tensor:
    """Merge the split-K partials of sequence b (normalised latents part_out [B, H, S, R] float32, log2-sum-exps
    part_lse [B, H, S]) into out[b] ([B, H, R], any batch/head strides). Only the splits that hold tokens of
    sequence b (partitions of `block_n`-token tiles, as the decode kernel's) are read, `chunk_s` split rows per
    load (None: by the split count, up to REDUCE_CHUNK_S). `inputs_ready` as in `mla_decode`."""
    bsz, heads, num_splits, rank = part_out.shape
    assert part_out.stride(-1) == 1 and part_lse.stride(-1) == 1 and out.stride(-1) == 1
    if chunk_s is None:
        chunk_s = min(REDUCE_CHUNK_S, max(4, next_pow2(num_splits)))
    _mla_reduce_kernel[(bsz, heads)](
        part_out, part_lse, seq_lens, out, part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1), num_splits,
        RANK=rank, BLOCK_R=max(16, next_pow2(rank)), BLOCK_S=max(64, next_pow2(num_splits)), BLOCK_N=block_n,
        CHUNK_S=chunk_s, INPUTS_READY=inputs_ready, num_warps=4, **pdl_launch_args(out))
    return out


def mla_reduce_ref(part_out, part_lse, seq_lens, out, block_n: int = MLA_BLOCK_N):
    """The PyTorch twin of `mla_reduce`."""
    used = active_splits_ref(seq_lens, part_out.shape[2], block_n)
    out.copy_(merge_splits_ref(part_out, part_lse, used))
    return out


def mla_decode_ref(q_lat, q_pe, kv_cache, block_tables, seq_lens, scale, out=None, max_seq_len=None,
                   num_splits=None):
    """The PyTorch twin: softmax over [q_lat | q_pe] . [c | k_pe] of each sequence's tokens, weighted latents
    (the latent-space half of `absorbed_attention` in deepserve/layers/mla.py), float32 throughout."""
    rank = q_lat.shape[-1]
    bs = kv_cache.shape[1]
    num_blocks = cdiv(int(seq_lens.max().item()), bs)
    cached = reference_attention.gather_blocks(kv_cache, block_tables[:, :num_blocks]).flatten(1, 2).float()
    mask = torch.arange(cached.shape[1], device=q_lat.device)[None, :] < seq_lens[:, None]
    query = torch.cat((q_lat.float(), q_pe.float()), dim=-1)                      # [B, H, R + P]
    scores = torch.matmul(query, cached.transpose(1, 2)) * scale
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    result = torch.matmul(torch.softmax(scores, dim=-1), cached[..., :rank])
    if out is None:
        return result.to(q_lat.dtype)
    out.copy_(result)
    return out


__all__ = ["mla_decode", "mla_decode_ref", "mla_num_splits", "mla_reduce", "mla_reduce_ref", "write_latents",
           "write_latents_ref", "rotary_write_latents", "rotary_write_latents_ref", "MLA_BLOCK_H", "MLA_BLOCK_N"]
