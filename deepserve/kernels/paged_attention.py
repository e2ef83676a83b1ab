"""Paged decode attention (GQA, split-K with a reduce step). The KV-cache writes (alone, or fused with the rotary
embedding of q and k) are kernels/kv_write.py; the varlen prefill over a paged cached prefix is
kernels/paged_prefill.py.

KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = keys, 1 = values); a token's
slot is block_id * block_size + offset. Any block size works (a block table entry is looked up per key).

Each launcher has a PyTorch twin with the same signature (`*_ref`), built from the engine's reference backend
(deepserve/layers/attention.py) so the kernels are tested against exactly what the CPU path computes.

Numerics: scores, softmax statistics and accumulators in float32; the probabilities are cast to the value dtype
for the P @ V product (as flash attention does), the output is rounded once to the query dtype. An 8-bit float cache
(kv_cache_dtype "fp8" / "fp8_e5m2") is written saturated and rounded to nearest (kernels/kv_rounding.py) and read
widened to the query's dtype, exactly, before the products.
"""

from dataclasses import dataclass, replace
from typing import Optional

import torch

from deepserve import envs
from deepserve.kernels import HAS_TRITON, cdiv, next_pow2, require_triton, tl, triton
from deepserve.kernels.kv_rounding import for_products, widen_keys, widen_values
from deepserve.kernels.l2_prefetch import (L2_PREFETCH_PIECE, L2_PREFETCH_PIECES, l2_prefetch_plan,
                                          prefetch_bytes_to_l2)
from deepserve.kernels.pdl import (EARLY_INPUTS, pdl_launch_args, pdl_launch_dependents, pdl_wait,
                                  pdl_wait_after_inputs, pdl_wait_for_inputs)
from deepserve.kernels.reference import attention as reference

_LOG2E = 1.4426950408889634


# ------------------------------------------------------------------------------------------------
# Decode: one query token per sequence, all G = H / Hkv query heads of a KV head in one program (the keys and
# values of a head group are read once), optionally split over the context (split-K) and merged by a reduce that
# reads only the splits a sequence uses.
# ------------------------------------------------------------------------------------------------
@triton.jit
def split_partition(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """Keys per split when a sequence of `seq_len` keys is spread over `num_splits` splits: whole BLOCK_N tiles.
    The partition follows this sequence's own length, not the launch's longest: a grid sized for a long context
    (a CUDA graph's, sized for max_model_len) still spreads a short one over several programs."""
    return tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def split_bounds(seq_len, split, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """[start, end) of the keys that split `split` (program axis 2) of a split-K decode reads; splits at or past
    `active_splits` are empty."""
    if SPLIT:
        partition = split_partition(seq_len, tl.num_programs(2), BLOCK_N)
        start = split * partition
        end = tl.minimum(start + partition, seq_len)
    else:
        start = 0
        end = seq_len
    return start, end


@triton.jit
def active_splits(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """How many splits hold keys: the first ones. The decode programs of the others exit without storing, so a
    reduce reads only these (a short context in a CUDA graph's grid uses a few of up to 128 splits)."""
    return tl.cdiv(seq_len, split_partition(seq_len, num_splits, BLOCK_N))


@triton.jit
def tile_blocks(table, tok, end, block_size):
    """Block ids (int64) of the keys `tok` of a sequence with block-table row `table`; 0 past `end`."""
    return tl.load(table + tok // block_size, mask=tok < end, other=0).to(tl.int64)


@triton.jit
def decode_row(q_rows_ptr, seq_ids_ptr, seq_lens_ptr, i):
    """(q row, sequence, sequence length) of decode row i."""
    row = tl.load(q_rows_ptr + i).to(tl.int64)
    seq = tl.load(seq_ids_ptr + i).to(tl.int64)
    return row, seq, tl.load(seq_lens_ptr + seq).to(tl.int32)


@triton.jit
def decode_row_inputs(q_rows_ptr, seq_ids_ptr, seq_lens_ptr, block_tables_ptr, stride_bt, i, split, block_size,
                      SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """What decode row i's program needs from the step's inputs: (its q row, its sequence, the sequence's length,
    the sequence's block-table row, the block ids of the first tile of split `split`)."""
    row, seq, seq_len = decode_row(q_rows_ptr, seq_ids_ptr, seq_lens_ptr, i)
    table = block_tables_ptr + seq * stride_bt
    start, end = split_bounds(seq_len, split, SPLIT, BLOCK_N)
    return row, seq, seq_len, table, tile_blocks(table, start + tl.arange(0, BLOCK_N), end, block_size)


@triton.jit
def _value_tile(v_base, off, v_off, d, kv_mask, run_mask, dtype: tl.constexpr, VALUES_T: tl.constexpr):
    """[BLOCK_N, BLOCK_D] values of a tile in `dtype`. VALUES_T: read from a tokens-contiguous layout (offsets
    v_off), so the product's operand is contiguous along its reduced dimension and an 8-bit tile can widen wherever
    Triton puts it (as keys do). Its mask (run_mask) keeps whole runs of 16 tokens, so the loads stay vectors: the
    slots past the sequence's end in its last run are read (a zeroed cache's, or older tokens': finite), and their
    probabilities are 0."""
    if VALUES_T:
        return widen_keys(tl.load(v_base + v_off, mask=run_mask, other=0.0), dtype)
    else:
        return widen_values(tl.load(v_base + off[:, None] + d[None, :], mask=kv_mask, other=0.0), dtype)


@triton.jit
def _own_columns(gmask, dmask, g, d, group, HEAD_DIM: tl.constexpr, KV_HEADS: tl.constexpr):
    """[BLOCK_G, BLOCK_D] mask of a decode program's q (and output) tile: live rows and columns, and with KV_HEADS 2
    only the columns of each row's own KV head (rows g of KV head g // group, columns d of head d // HEAD_DIM)."""
    mask = gmask[:, None] & dmask[None, :]
    if KV_HEADS > 1:
        mask = mask & ((g // group)[:, None] == (d // HEAD_DIM)[None, :])
    return mask


@triton.jit
def _merge_own_splits(part_out_ptr, part_lse_ptr, out_ptr, row, head, first, num_heads, used, stride_ot, stride_oh,
                      HEAD_DIM: tl.constexpr, MERGE_G: tl.constexpr, MERGE_S: tl.constexpr):
    """The split merge of `_decode_reduce_kernel` for `num_heads` query heads from `head` of q row `row`, in one
    [MERGE_G, MERGE_S, HEAD_DIM] tile: one round trip for all of a program's heads. The partials lie packed
    ([rows, heads, MERGE_S, HEAD_DIM] and [rows, heads, MERGE_S]; `first`: the (decode row, head) pair's index),
    so the tile is a contiguous run that loads as 16-byte vectors (far fewer registers than one pointer per element
    would take). They were stored by other programs of this launch: loaded from L2 (.cg), past this SM's L1."""
    g = tl.arange(0, MERGE_G)
    s = tl.arange(0, MERGE_S)
    d = tl.arange(0, HEAD_DIM)
    g_ok = g < num_heads
    gs_ok = g_ok[:, None] & (s < used)[None, :]
    gs = g[:, None] * MERGE_S + s[None, :]
    lse = tl.load(part_lse_ptr + first * MERGE_S + gs, mask=gs_ok, other=float("-inf"), cache_modifier=".cg")
    lse = tl.where(g_ok[:, None], lse, 0.0)          # padded heads: finite weights, never stored
    w = tl.math.exp2(lse - tl.max(lse, 1)[:, None])  # [G, S]; 0 for the empty splits (split 0 holds key 0)
    o = tl.load(part_out_ptr + first * (MERGE_S * HEAD_DIM) + gs[:, :, None] * HEAD_DIM + d[None, None, :],
                mask=gs_ok[:, :, None], other=0.0, cache_modifier=".cg")
    out = tl.sum(o * w[:, :, None], 1) / tl.sum(w, 1)[:, None]
    tl.store(out_ptr + row * stride_ot + (head + g)[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None])


# Arguments that change from step to step (block-table width, split layout) are not specialised on: Triton would
# otherwise compile a new variant whenever one of them changes between "divisible by 16" and not, mid-serving.
_PER_STEP_ARGS = ["stride_bt", "stride_po_r", "stride_po_h", "stride_pl_r", "stride_pl_h"]


@triton.jit(do_not_specialize=_PER_STEP_ARGS)
def _decode_kernel(q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, q_rows_ptr, seq_ids_ptr,
                   out_ptr, part_out_ptr, part_lse_ptr, count_ptr,
                   qk_scale,
                   stride_qt, stride_qh, stride_ot, stride_oh,
                   stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,
                   stride_bt,
                   stride_po_r, stride_po_h, stride_po_s, stride_pl_r, stride_pl_h,
                   block_size, group,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPLIT: tl.constexpr, EARLY_V: tl.constexpr, HEADS_FIRST: tl.constexpr, VALUES_T: tl.constexpr,
                   KV_HEADS: tl.constexpr, INPUTS_READY: tl.constexpr, USE_PDL: tl.constexpr,
                   MERGE_LAST: tl.constexpr = False, MERGE_G: tl.constexpr = 1, MERGE_S: tl.constexpr = 1,
                   LATE_TRIGGER: tl.constexpr = False):
    """One (decode row, KV_HEADS adjacent KV heads, split). KV_HEADS 2 (DecodeTiles.kv_heads): a tile row holds
    both heads' HEAD_DIM columns side by side (one load of 2 * HEAD_DIM contiguous elements a token), and the q tile
    stacks both heads' query groups, each row zero outside its own head's columns (`_own_columns`): the scores are
    each head's own, and of the [rows, 2 * HEAD_DIM] output each row keeps its own head's half.
    MERGE_LAST (split launches): each program counts itself done in count_ptr's counter of its (row, KV heads), and
    the last of the row's active splits to do so merges them all into `out` (`_merge_own_splits`) and zeroes the
    counter for the next launch: no reduce launch. The order is CUTLASS's semaphore's: every thread's stores, a CTA
    barrier, then one release-acquire atomic at GPU scope; the merge reads the partials after it."""
    if HEADS_FIRST:                # the KV heads of one row launch side by side (DecodeTiles.heads_first)
        kvh = tl.program_id(0) * KV_HEADS
        i = tl.program_id(1)
    else:
        i = tl.program_id(0)       # decode row
        kvh = tl.program_id(1) * KV_HEADS
    split = tl.program_id(2)
    # With INPUTS_READY (the step's inputs were in place before its first kernel) their loads, and the first tile's
    # block ids, overlap the previous kernel instead of adding three round trips after the wait (kernels/pdl.py).
    # LATE_TRIGGER (with MERGE_LAST over 2+ rows, decode_attention): the next kernel, o_proj's skinny GEMM with no
    # reduce between, starts as this grid's programs exit. Let in early, its programs slowed Llama-3.2-1B batch-2
    # steps by 7% (H100, split_merge_*_h100_s42.json); at batch 1 the early start pays (o_proj is a GEMV there).
    pdl_wait_for_inputs(INPUTS_READY, USE_PDL, not LATE_TRIGGER)
    row, seq, seq_len, table, first_blk = decode_row_inputs(q_rows_ptr, seq_ids_ptr, seq_lens_ptr, block_tables_ptr,
                                                            stride_bt, i, split, block_size, SPLIT, BLOCK_N)
    pdl_wait_after_inputs(INPUTS_READY, USE_PDL, not LATE_TRIGGER)
    start, end = split_bounds(seq_len, split, SPLIT, BLOCK_N)
    if SPLIT:
        if start >= end:        # an empty split: the reduce does not read it, so nothing to load or store
            return

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gmask = g < KV_HEADS * group
    dmask = d < KV_HEADS * HEAD_DIM
    heads = kvh * group + g        # the query heads of KV heads kvh .. kvh + KV_HEADS - 1 are consecutive
    qo_mask = _own_columns(gmask, dmask, g, d, group, HEAD_DIM, KV_HEADS)
    hd = d % HEAD_DIM if KV_HEADS > 1 else d
    q = for_products(tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + hd[None, :],
                             mask=qo_mask, other=0.0), cache_ptr)

    k_base = cache_ptr + kvh * stride_c_head
    if VALUES_T:    # each block's values stored [KV heads, head_dim, block_size]: a value tile loads tokens-contiguous
        v_base = cache_ptr + stride_c_kv + kvh * (HEAD_DIM * block_size)
    else:
        v_base = k_base + stride_c_kv
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    blk = first_blk
    # Every tile holds at least one real key (the loop stops at `end`), so m_i is finite after the first tile.
    for n0 in range(start, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        tmask = tok < end
        off = blk * stride_c_block + (tok % block_size).to(tl.int64) * stride_c_slot
        if VALUES_T:
            slot = blk * stride_c_block + (tok % block_size).to(tl.int64)
            # Runs of 16 tokens lie side by side (block_size >= 16, a multiple of 16 bytes apart): vector loads.
            v_off = tl.max_contiguous(tl.multiple_of(slot[:, None] + d[None, :].to(tl.int64) * block_size, [16, 16]),
                                      [16, 1])
            run_mask = ((tok // 16 * 16) < end)[:, None] & dmask[None, :]
        else:
            run_mask = None
        blk = tile_blocks(table, tok + BLOCK_N, end, block_size)     # the next tile's, a round trip ahead
        kv_mask = tmask[:, None] & dmask[None, :]
        # An fp8 cache's codes widen to q's dtype here (a no-op for a cache of q's dtype).
        k = widen_keys(tl.load(k_base + off[:, None] + d[None, :], mask=kv_mask, other=0.0), q.dtype)
        if EARLY_V:     # the value tile's load issued with the key tile's: twice the bytes in flight
            v = _value_tile(v_base, off, v_off if VALUES_T else off, d, kv_mask, run_mask, q.dtype, VALUES_T)
        s = tl.dot(q, tl.trans(k)) * qk_scale                      # [BLOCK_G, BLOCK_N], log2 domain
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if not EARLY_V:
            v = _value_tile(v_base, off, v_off if VALUES_T else off, d, kv_mask, run_mask, q.dtype, VALUES_T)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if SPLIT:
        # Partial result of this (non-empty) split: normalised output and log2-sum-exp.
        o = acc / l_i[:, None]
        lse = m_i + tl.math.log2(l_i)
        tl.store(part_out_ptr + i * stride_po_r + heads[:, None] * stride_po_h + split * stride_po_s + hd[None, :],
                 o, mask=qo_mask)
        tl.store(part_lse_ptr + i * stride_pl_r + heads * stride_pl_h + split, lse, mask=gmask)
        if MERGE_LAST:
            kvh_programs = tl.num_programs(0) if HEADS_FIRST else tl.num_programs(1)
            counter = count_ptr + i * kvh_programs + kvh // KV_HEADS
            tl.debug_barrier()          # every thread's partial is stored before the count says so
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            used = active_splits(seq_len, tl.num_programs(2), BLOCK_N)
            if done == used - 1:
                # The partials are packed here (decode_attention): row i's heads from i * all heads.
                first = i.to(tl.int64) * (kvh_programs * KV_HEADS * group) + kvh * group
                _merge_own_splits(part_out_ptr, part_lse_ptr, out_ptr, row, kvh * group, first, KV_HEADS * group, used,
                                  stride_ot, stride_oh, HEAD_DIM, MERGE_G, MERGE_S)
                tl.store(counter, 0)    # for the next launch (the next layer's, a CUDA graph's next replay)
    else:
        o = acc / l_i[:, None]
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + hd[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=qo_mask)


@triton.jit(do_not_specialize=_PER_STEP_ARGS[1:] + ["num_splits", "pf_bytes", "num_rows"])
def _decode_reduce_kernel(part_out_ptr, part_lse_ptr, q_rows_ptr, seq_ids_ptr, seq_lens_ptr, out_ptr,
                          stride_po_r, stride_po_h, stride_po_s, stride_pl_r, stride_pl_h,
                          stride_ot, stride_oh, num_splits, pf_ptr, pf_bytes, num_rows,
                          HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                          BLOCK_N: tl.constexpr, INPUTS_READY: tl.constexpr, PREFETCH: tl.constexpr,
                          PF_PIECES: tl.constexpr, PF_PIECE: tl.constexpr, USE_PDL: tl.constexpr):
    """Merge the splits of one (decode row, head) by their log-sum-exp, in one [BLOCK_S, BLOCK_D] tile. Only the
    active splits are loaded: the empty ones' lanes take lse = -inf and o = 0 (weight 0), the values their
    programs used to store, so the sum is the same, lane for lane.
    PREFETCH (an L2Prefetch policy, 0 none): the programs of rows past num_rows ask L2 for pf_bytes of pf_ptr
    (kernels/l2_prefetch.py), a piece each in (row, head) order, then wait."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    if PREFETCH:
        if i >= num_rows:
            prefetch_bytes_to_l2(pf_ptr, (i - num_rows) * tl.num_programs(1) + h, pf_bytes, PREFETCH, PF_PIECES,
                                 PF_PIECE)
            pdl_wait(USE_PDL)           # kernels/pdl.py, rule 2
            pdl_launch_dependents(USE_PDL)
            return
    pdl_wait_for_inputs(INPUTS_READY, USE_PDL)    # the previous kernel (the decode's) writes none of them
    row, seq, seq_len = decode_row(q_rows_ptr, seq_ids_ptr, seq_lens_ptr, i)
    pdl_wait_after_inputs(INPUTS_READY, USE_PDL)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    smask = s < active_splits(seq_len, num_splits, BLOCK_N)
    lse = tl.load(part_lse_ptr + i * stride_pl_r + h * stride_pl_h + s, mask=smask, other=float("-inf"))
    lse_max = tl.max(lse, 0)                       # finite: split 0 always holds key 0
    w = tl.math.exp2(lse - lse_max)                 # 0 for empty splits
    o = tl.load(part_out_ptr + i * stride_po_r + h * stride_po_h + s[:, None] * stride_po_s + d[None, :],
                mask=smask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + row * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


_NUM_SMS: dict = {}


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


DECODE_BLOCK_N = 64


@dataclass(frozen=True)
class DecodeTiles:
    """Launch settings of the paged decode kernel: keys per tile, warps, pipeline stages, whether a tile's values
    load together with its keys (`early_v`) or after the scores, and the launch order (`heads_first`: the programs
    of one row's KV heads side by side, which read neighbouring pieces of the same cache rows at about the same
    time; else one KV head's rows side by side)."""
    block_n: int = DECODE_BLOCK_N
    num_warps: int = 4
    num_stages: int = 2
    early_v: bool = False
    heads_first: bool = False
    maxnreg: Optional[int] = None     # a register cap a thread (Triton's maxnreg; None: ptxas's choice)
    # Values stored transposed in each block ([KV heads, head_dim, slots]): an experiment's cache layout, which no
    # KV writer produces yet (benchmarks/fp8_attention_kernels.py times it on a transposed copy; lost with 16-slot
    # blocks, gqa_values_transposed_h200_s37.json; the gpu_pending stage values-t64 times it with 64-slot blocks).
    values_t: bool = False
    # KV heads a program reads side by side (2: `_decode_kernel`'s KV_HEADS, for heads of 128 bytes a token, whose
    # pieces of a token's row read at 81% of the copy bandwidth where Qwen3-MoE's 256-byte bf16 ones read at 93%:
    # H100, dense1b_attention_tiles_h100_s35.json, qwen3_attention_tiles_h100_s35.json). kv_heads_a_program picks it.
    kv_heads: int = 1

# A no-split launch whose programs fit on the SMs two at a time (in 128-wide heads): a third pipeline stage, the value
# tile loaded with the key tile. Three stages of key + value tiles (64 x 128 bf16 each) are 96 KB of shared memory,
# so two such programs fit an SM where the default's fit five (Nsight Compute: 39 KB a program, five an SM).
# Measured on an H200 in a step's surroundings
# (benchmarks/decode_attention_in_step.py, decode_attention_in_step_h200.json; us per layer, default -> these) at
# 256 programs: Llama-3-8B batch 32 47.0 -> 38.5 (1k context), 165.5 -> 125.0 (4k); Qwen3-MoE batch 64 47.1 -> 40.1;
# Llama-3.2-1B batch 64 (512 programs of 64-wide heads) 43.9 -> 38.2. At 512 programs of 128-wide heads they take
# two waves and lose (Llama-3-8B batch 64 69.4 -> 87.3, Qwen3-MoE batch 128 70.5 -> 88.9): the default stays there.
# Decode steps (session21_steps_ab_h200.json, ms): Llama-3-8B batch 32 9.29 -> 8.55 at 4k, 5.76 -> 5.63 at 1k;
# Llama-3.2-1B batch 64 3.85 -> 3.66 at 4k; Qwen3-MoE batch 64 6.11 -> 6.03.
DEEP_PIPELINE_TILES = DecodeTiles(num_stages=3, early_v=True)

# DEEPSERVE_GQA_DECODE_LAUNCH=heads-first (the default): the programs of one row's KV heads launch side by side. One
# token's heads lie side by side in the cache (a 128-wide E4M3 head is a 128-byte piece of Qwen3-MoE's 512-byte
# row), so programs launched together read whole rows at about the same time. Unsplit launches past the deep
# pipeline's range over an fp8 cache take three stages: an fp8 tile is half a bf16 one's bytes, and the device's
# two-stage build already holds only 4 programs an SM (110 registers, ncu_gqa_large_h100_s36.json). H100, one
# layer's call (gqa_heads_first_kernels_h100_s36.json): Qwen3-MoE batch 256 over E4M3 110.7 -> 104.9 us; its decode
# steps, three passes, 9.760 -> 9.737 ms (PDL hid most of the old launch's cost); Llama-3.2-1B batch 64 over bf16
# 2.219 -> 2.195 ms. docs/gpu.md has the rest (bf16 keeps two stages there; steps at other batches).
HEADS_FIRST = envs.DEEPSERVE_GQA_DECODE_LAUNCH == "heads-first"
# DEEPSERVE_GQA_KV_HEADS_PER_PROGRAM (session 38's; timed in session 40): heads of at most PAIRED_HEAD_BYTES a token
# are read two KV heads a program (DecodeTiles.kv_heads), where the KV heads are even and lie side by side. "auto"
# (the default) pairs them over a 16-bit cache in a launch without a split whose programs fit the SMs in one wave
# (`fits_one_wave`, DEEP_PIPELINE_TILES' range): Llama-3.2-1B's 64-wide bf16 heads at batch 64, decode steps 2-5%
# faster on an H100 and an H200 (ms, one head / two, 1k and 4k: H100 2.184 / 4.631 -> 2.135 / 4.429,
# gqa_kv_pairs_ab_h100_s40.json; H200, two passes, 1.746-1.758 / 3.461-3.518 -> 1.713-1.715 / 3.293-3.313,
# gqa_pairs_auto_b256_ab_h200_s40.json). Past one wave the machines disagreed (batch 256: H100 4.765 / 13.811 ->
# 4.661 / 13.323; H200 3.756 / 9.874-9.987 -> 3.754-3.761 / 10.276-10.279), and split launches lost (batch 8: H100
# 1.316 / 1.626 -> 1.436 / 1.772, half the programs where there are too few already), as did 128-wide E4M3 heads
# at kernel level (Qwen3-MoE batch 256 104.7 -> 106.4-127.5 us by tiling, gqa_kv_pairs_kernels_h100_s40.json).
# "2": wherever they pair; "1": never.
KV_HEADS_PER_PROGRAM = envs.DEEPSERVE_GQA_KV_HEADS_PER_PROGRAM
PAIRED_HEAD_BYTES = 128


# DEEPSERVE_DECODE_SPLIT_MERGE (session 42's): "last" merges a split launch's partials in the decode kernel itself,
# by the last split program of each (row, KV heads) to finish (`_decode_kernel`'s MERGE_LAST), instead of a reduce
# launch after it; over 2+ rows the next kernel starts as the decode's programs exit (LATE_TRIGGER). H100,
# Llama-3.2-1B steps, two passes each (split_merge_*_h100_s42.json): at 1k batch 1 1.076-1.090 -> 1.063-1.076 ms in
# four runs, batch 32 1.700-1.748 -> 1.629-1.647, batch 2 / 8 within 1.5% either way; at 4k batch 8 / 32 1.6% / 4%
# faster. Over 2-16 rows with the next kernel let in early it was 4-7% slower (batch 2 1.170 -> 1.251-1.257).
# The merge tile holds all of a program's heads, [heads, splits, head_dim] in float32, packed (the 1B's split build
# keeps its 64 registers at 16 splits: kernel_resources_split_merge_s42.json). Past MERGE_MAX_ELEMENTS the launch
# keeps its reduce, as it does where the reduce carries an L2 prefetch: tiles of 8192 were mixed (Llama-3-8B batch 8
# 0.6-1.3% slower in three pairs, Qwen3-MoE batch 32 0.9% faster in one).
SPLIT_MERGE = envs.DEEPSERVE_DECODE_SPLIT_MERGE
MERGE_MAX_ELEMENTS = 4096
# The merge counters: one int32 per (row, KV-head program) of a split launch, zero between launches (the last
# program of each zeroes its own). Allocated once per device at SPLIT_COUNTERS slots, never reallocated: a CUDA
# graph keeps the pointer it captured. Launches on one device run one after another (one stream), so they share it.
SPLIT_COUNTERS = 1 << 16
_COUNTERS: dict = {}


def split_counters(device: torch.device) -> torch.Tensor:
    key = (device.type, device.index)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def merge_tile(num_heads: int, num_splits: int, head_dim: int) -> Optional[tuple[int, int]]:
    """(MERGE_G, MERGE_S) of a split launch's in-kernel merge for programs of `num_heads` query heads: its tile is
    [MERGE_G, MERGE_S, head_dim]. None where that is past MERGE_MAX_ELEMENTS or the head width is not a power of two
    (the partials are packed at it): the launch keeps its reduce."""
    tile = (next_pow2(num_heads), next_pow2(num_splits))
    return tile if tile[0] * tile[1] * head_dim <= MERGE_MAX_ELEMENTS and head_dim == next_pow2(head_dim) else None


def fits_one_wave(num_programs: int, head_dim: int, split: bool, device: torch.device) -> bool:
    """A launch without a split whose `num_programs` programs of `head_dim`-wide heads fit the SMs at two 128-wide
    programs each: DEEP_PIPELINE_TILES' range, and where "auto" pairs KV heads."""
    return not split and num_programs * head_dim <= 2 * num_sms(device) * 128


def kv_heads_a_program(head_dim: int, cache_elem_bytes: int, num_kv_heads: int, heads_adjacent: bool,
                       one_wave: bool, mode: str = "") -> int:
    """KV heads one decode program reads (DecodeTiles.kv_heads) under `mode` (default KV_HEADS_PER_PROGRAM): 2 only
    for heads of at most PAIRED_HEAD_BYTES a token, an even count, side by side in the cache's rows (`heads_adjacent`);
    "auto" also asks for a one-wave launch without a split (`one_wave`, `fits_one_wave`) over a 16-bit cache (the
    measured rule above)."""
    mode = mode or KV_HEADS_PER_PROGRAM
    can_pair = head_dim * cache_elem_bytes <= PAIRED_HEAD_BYTES and num_kv_heads % 2 == 0 and heads_adjacent
    if mode == "1" or not can_pair:
        return 1
    if mode == "auto" and (not one_wave or cache_elem_bytes != 2):
        return 1
    return 2


def decode_tiles(num_programs: int, head_dim: int, split: bool, device: torch.device,
                 fp8_cache: bool = False) -> DecodeTiles:
    """The decode kernel's launch setting for `num_programs` programs (rows x KV heads x splits) of `head_dim`-wide
    heads: DEEP_PIPELINE_TILES for a launch without a split that fits the SMs at two 128-wide programs each; past
    that, without a split, three stages over an fp8 cache (`fp8_cache`); else the default (split launches are sized
    for about four programs an SM). All with HEADS_FIRST's launch order."""
    if fits_one_wave(num_programs, head_dim, split, device):
        return replace(DEEP_PIPELINE_TILES, heads_first=HEADS_FIRST)
    if not split and fp8_cache and HEADS_FIRST:
        return DecodeTiles(num_stages=3, heads_first=True)
    return DecodeTiles(heads_first=HEADS_FIRST)


_MIN_PARTITION = 128     # keys per split at least
_FULL_WAVE = 1.9         # programs per SM (of 128-wide heads) that need no split: 250 on an H200's 132 SMs
# DEEPSERVE_DECODE_SPLIT_RULE: "merged" sizes the splits of a launch that merges in the kernel for that merge
# (decode_num_splits' second paragraph); "reduce" keeps session 42's counts, sized for a reduce launch, everywhere.
SPLIT_RULE = envs.DEEPSERVE_DECODE_SPLIT_RULE
_MERGED_MIN_PARTITION = 64     # keys per split at least where the merge is in the kernel: one 64-key tile


def merge_max_splits(num_heads: int, head_dim: int) -> int:
    """The most splits an in-kernel merge over programs of `num_heads` query heads holds (`merge_tile`'s limit): 0
    where it holds none (a head width that is not a power of two)."""
    if head_dim != next_pow2(head_dim):
        return 0
    return MERGE_MAX_ELEMENTS // (next_pow2(num_heads) * head_dim)


def decode_num_splits(num_rows: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                      head_dim: int = 128, merge_heads: int = 0) -> int:
    """How many splits of the context a decode launch gets (one program per row, KV head and split).

    No split once (rows x KV heads) programs, counted in 128-wide heads (a 64-wide head's program moves half the
    bytes), reach about two per SM: there a split's reduce launch costs more than the parallelism gains (Qwen3-MoE
    at batch 64, 256 programs of 128-wide heads: 45 us without a split, 54 us with 2). Below that, enough splits
    for about four programs per SM, each of at least _MIN_PARTITION keys. Measured on an H200 for 64- and 128-wide
    heads, groups 4 and 8, batch 8 to 256, contexts 1k and 4k (benchmarks/tune_decode_attention.py,
    tune_decode_attention.json): within 12% of the best measured split count in 28 of 29 cases and 19% in the
    last (Llama-3-8B at batch 32 and 4k, where 2 splits win), against up to 38% for the rule before (1B, batch 8,
    4k context).

    `merge_heads` > 0: the launch merges its splits in the kernel, over programs of that many query heads (SPLIT_RULE
    "merged"; 0: a reduce launch). A split then costs its partial's write and one program's read of them, no
    launch, and on an H100 (merge_splits_*_h100_s43.json, every split count at kernel level):
    - partitions of one 64-key tile where that count fits the merge tile (Llama-3.2-1B batch 1 at 1k: 16 splits
      4.74 us against 8's 5.54);
    - the merge tile's count where the rule asks for at most half again as many, which would take the reduce
      (Qwen3-MoE batch 32 at 4k: 4 splits against 5's 56.5 / 94.0 against 62.5 / 101.9 us over E4M3 / bf16).
    Decode steps, two passes (split_rule_*_ab_h100_s43.json): Qwen3-MoE over E4M3 at batch 32 6.842-6.845 ->
    6.743-6.744 ms (4 splits, not 5). Past the one-wave line nothing splits still: 2 splits there were 7-12% faster
    at kernel level (batch 64 of Llama-3.2-1B / Qwen3-MoE, batch 32 of Llama-3-8B, 1k and 4k) but not in steps,
    with either PDL trigger (Llama-3.2-1B batch 64 at 1k 2.109-2.125 -> 2.151-2.162 ms, at 4k 0.7-1.2% slower;
    Llama-3-8B batch 32 at 4k 0.3-0.7% faster; split_rule_*_ab_h100_s43.json, split_wide_*_ab_h100_s43.json). The
    one-tile partitions did not show in those steps: their graphs are sized for ~1.1k keys, where 16 splits round
    to 9 of 128 keys (`decode_attention`), as before; they apply to launches sized for at most 16 tiles.
    """
    programs = max(1, num_rows * num_kv_heads)
    sms = num_sms(device)
    wide = programs * head_dim / (sms * 128)            # 128-wide programs an SM
    most = merge_max_splits(merge_heads, head_dim) if merge_heads and SPLIT_RULE == "merged" else 0
    if wide >= _FULL_WAVE:
        return 1
    splits = max(1, min(cdiv(4 * sms, programs), cdiv(max_seq_len, _MIN_PARTITION), 64))
    if most:
        short = max(1, min(cdiv(4 * sms, programs), cdiv(max_seq_len, _MERGED_MIN_PARTITION), 64))
        if short <= most:
            return short
        if splits <= most + most // 2:
            return most
    return splits


def launch_num_splits(num_rows: int, num_heads: int, kv_cache: torch.Tensor, max_seq_len: int,
                      merging: bool) -> int:
    """`decode_num_splits` for a launch of `num_rows` rows of `num_heads` query heads over `kv_cache` ([2, blocks,
    block size, KV heads, head_dim]) that merges its splits in the kernel if `merging` (DEEPSERVE_DECODE_SPLIT_MERGE
    "last" and no L2 prefetch at the reduce). The merge holds a split program's heads: its KV heads (pairs only
    where KV_HEADS_PER_PROGRAM pairs split launches) times the group."""
    hkv, d = kv_cache.shape[3], kv_cache.shape[4]
    pairs = kv_heads_a_program(d, kv_cache.element_size(), hkv, kv_cache.stride(3) == d, False)
    merge_heads = pairs * (num_heads // hkv) if merging else 0
    return decode_num_splits(num_rows, hkv, max_seq_len, kv_cache.device, d, merge_heads)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, out: Optional[torch.Tensor] = None, q_rows: Optional[torch.Tensor] = None,
                     seq_ids: Optional[torch.Tensor] = None, max_seq_len: Optional[int] = None,
                     num_splits: Optional[int] = None, inputs_ready: bool = False,
                     tiles: Optional[DecodeTiles] = None, l2_prefetch: Optional[torch.Tensor] = None,
                     split_merge: Optional[str] = None) -> torch.Tensor:
    """Attention of one query token per sequence over its paged keys.

    q: [T, H, D]; the decode rows are `q_rows` (default: all T rows), row i belonging to sequence `seq_ids[i]`
    (default i) of `block_tables` [B, max_blocks] / `seq_lens` [B]. Writes rows `q_rows` of `out` ([T, H, D],
    allocated when None) and returns it. `max_seq_len` (host int) sizes the split; `num_splits` forces it.
    `inputs_ready`: q_rows, seq_ids, seq_lens and block_tables were in place before the kernel launched just
    before this call (the attention backends' per-step metadata), so they may be read before the PDL wait.
    `tiles` forces the launch settings (tuning); None: `DecodeTiles()`. `l2_prefetch`: the weight read next
    (o_proj's), which a split launch's reduce may ask into L2 (kernels/l2_prefetch.py); it changes no result.
    `split_merge` ("reduce" / "last", default SPLIT_MERGE): how a split launch's partials merge.
    """
    require_triton(q)
    t, h, d = q.shape
    hkv = kv_cache.shape[3]
    assert h % hkv == 0 and kv_cache.shape[4] == d and q.stride(-1) == 1 and kv_cache.stride(-1) == 1
    group = h // hkv
    if out is None:
        out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    # Default rows come from a kernel launched just before: not ready for a pre-wait read.
    assert not inputs_ready or (q_rows is not None and seq_ids is not None), "inputs_ready needs q_rows, seq_ids"
    if q_rows is None:
        q_rows = torch.arange(t, device=q.device)
    if seq_ids is None:
        seq_ids = torch.arange(q_rows.shape[0], device=q.device)
    n = q_rows.shape[0]
    if n == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if seq_lens.numel() else 1
    merging = (split_merge or SPLIT_MERGE) == "last" and l2_prefetch_plan(l2_prefetch, n, out, "reduce").programs == 0
    if num_splits is None:
        num_splits = launch_num_splits(n, h, kv_cache, max_seq_len, merging)
    # Both tilings key on 64 keys per tile, so a forced split count means the same partition under either.
    block_n = (tiles or DecodeTiles()).block_n
    partition = cdiv(cdiv(max_seq_len, num_splits), block_n) * block_n
    num_splits = max(1, cdiv(max_seq_len, partition))
    if tiles is None:
        tiles = decode_tiles(n * hkv * num_splits, d, num_splits > 1, q.device, fp8_cache=kv_cache.element_size() == 1)
        pairs = kv_heads_a_program(d, kv_cache.element_size(), hkv, kv_cache.stride(3) == d,
                                   fits_one_wave(n * hkv, d, num_splits > 1, q.device))
        if pairs != 1:
            tiles = replace(tiles, kv_heads=pairs)
    assert tiles.block_n == block_n
    kvh_programs, rem = divmod(hkv, tiles.kv_heads)
    assert tiles.kv_heads in (1, 2) and rem == 0 and (tiles.kv_heads == 1 or kv_cache.stride(3) == d), \
        f"{tiles.kv_heads} KV heads a program: {hkv} KV heads side by side in the cache's rows"
    assert not tiles.values_t or kv_cache.shape[2] % 16 == 0, "values stored transposed need blocks of 16k slots"
    bs = kv_cache.shape[2]
    block_d = next_pow2(tiles.kv_heads * d)
    block_g = max(16, next_pow2(tiles.kv_heads * group))
    split = num_splits > 1
    merge = None
    if split and merging and n * kvh_programs <= SPLIT_COUNTERS:
        merge = merge_tile(tiles.kv_heads * group, num_splits, d)
    if split:
        # Packed at the merge tile's splits for an in-kernel merge (`_merge_own_splits` reads them as one run).
        slots = merge[1] if merge else num_splits
        part_out = torch.empty(n, h, slots, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(n, h, slots, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out   # unused
    po_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2)) if split else (0, 0, 0)
    pl_strides = (part_lse.stride(0), part_lse.stride(1)) if split else (0, 0)
    counters = split_counters(q.device) if merge else out
    assert not tiles.heads_first or n < 65536, "a grid's second dimension holds fewer than 65536 programs"
    _decode_kernel[(kvh_programs, n, num_splits) if tiles.heads_first else (n, kvh_programs, num_splits)](
        q, kv_cache, block_tables, seq_lens, q_rows, seq_ids, out, part_out, part_lse, counters,
        scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), *po_strides, *pl_strides,
        bs, group,
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_G=block_g, BLOCK_N=block_n, SPLIT=split, EARLY_V=tiles.early_v,
        HEADS_FIRST=tiles.heads_first, VALUES_T=tiles.values_t, KV_HEADS=tiles.kv_heads,
        INPUTS_READY=inputs_ready and EARLY_INPUTS, MERGE_LAST=merge is not None,
        LATE_TRIGGER=merge is not None and n > 1,
        **(dict(zip(("MERGE_G", "MERGE_S"), merge)) if merge else {}),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **({"maxnreg": tiles.maxnreg} if tiles.maxnreg else {}),
        **pdl_launch_args(q))
    if split and merge is None:
        # The decode kernel, the reduce's predecessor, writes none of the inputs: they are ready for it.
        decode_reduce(part_out, part_lse, q_rows, seq_ids, seq_lens, out, inputs_ready=EARLY_INPUTS,
                      block_n=block_n, l2_prefetch=l2_prefetch)
    return out


def decode_reduce(part_out: torch.Tensor, part_lse: torch.Tensor, q_rows: torch.Tensor, seq_ids: torch.Tensor,
                  seq_lens: torch.Tensor, out: torch.Tensor, inputs_ready: bool = False,
                  block_n: int = DECODE_BLOCK_N, l2_prefetch: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Merge the split-K partials of decode row i (normalised outputs part_out [n, H, S, D] float32 and their
    log2-sum-exps part_lse [n, H, S]) into out[q_rows[i]]. Only the splits that hold keys of sequence seq_ids[i]
    (DECODE_BLOCK_N tiles, see `split_partition`) are read. `inputs_ready` and `l2_prefetch` as in
    `decode_attention`."""
    n, h, num_splits, d = part_out.shape
    assert part_out.stride(-1) == 1 and part_lse.stride(-1) == 1
    prefetch = l2_prefetch_plan(l2_prefetch, n, out, "reduce")
    _decode_reduce_kernel[(n + cdiv(prefetch.programs, h), h)](
        part_out, part_lse, q_rows, seq_ids, seq_lens, out,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), num_splits, prefetch.tensor, prefetch.nbytes, n,
        HEAD_DIM=d, BLOCK_D=next_pow2(d), BLOCK_S=max(64, next_pow2(num_splits)), BLOCK_N=block_n,
        INPUTS_READY=inputs_ready, PREFETCH=prefetch.policy, PF_PIECES=L2_PREFETCH_PIECES,
        PF_PIECE=L2_PREFETCH_PIECE, num_warps=4, **pdl_launch_args(out))
    return out


def active_splits_ref(seq_lens: torch.Tensor, num_splits: int, block_n: int) -> torch.Tensor:
    """The PyTorch twin of `active_splits`, per sequence."""
    partition = (seq_lens + num_splits - 1) // num_splits
    partition = (partition + block_n - 1) // block_n * block_n
    return (seq_lens + partition - 1) // partition


def merge_splits_ref(part_out: torch.Tensor, part_lse: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """Float32 log-sum-exp merge of partials [n, H, S, D] / [n, H, S] over each row's first `used[i]` splits
    (the others are never read: they may hold anything)."""
    live = torch.arange(part_lse.shape[-1], device=part_lse.device)[None, :] < used[:, None]       # [n, S]
    lse = torch.where(live[:, None, :], part_lse, float("-inf"))
    w = torch.exp2(lse - lse.amax(-1, keepdim=True))
    o = torch.where(live[:, None, :, None], part_out, 0.0)
    return (o * w[..., None]).sum(-2) / w.sum(-1, keepdim=True)


def decode_reduce_ref(part_out, part_lse, q_rows, seq_ids, seq_lens, out):
    """The PyTorch twin of `decode_reduce`."""
    used = active_splits_ref(seq_lens[seq_ids], part_out.shape[2], DECODE_BLOCK_N)
    out[q_rows] = merge_splits_ref(part_out, part_lse, used).to(out.dtype)
    return out


def decode_attention_ref(q, kv_cache, block_tables, seq_lens, scale, out=None, q_rows=None, seq_ids=None,
                         max_seq_len=None, num_splits=None):
    """The PyTorch twin: gathers each row's keys and runs the reference backend's decode attention."""
    t = q.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if q_rows is None:
        q_rows = torch.arange(t, device=q.device)
    if seq_ids is None:
        seq_ids = torch.arange(q_rows.shape[0], device=q.device)
    if q_rows.shape[0] == 0:
        return out
    bs = kv_cache.shape[2]
    lens = seq_lens[seq_ids]
    lmax = int(lens.max().item())
    pos = torch.arange(lmax, device=q.device)
    tables = block_tables[seq_ids]
    slots = tables.gather(1, (pos // bs)[None, :].expand(len(seq_ids), -1).clamp(max=tables.shape[1] - 1)) * bs \
        + pos % bs
    mask = pos[None, :] < lens[:, None]
    slots = torch.where(mask, slots, 0)
    k_flat = reference.as_bytes(kv_cache[0]).flatten(0, 1)      # fp8 codes gathered as bytes
    v_flat = reference.as_bytes(kv_cache[1]).flatten(0, 1)
    out[q_rows] = reference.masked_decode_attention(q[q_rows], k_flat[slots].view(kv_cache.dtype),
                                                    v_flat[slots].view(kv_cache.dtype), mask, scale)
    return out


__all__ = ["EARLY_INPUTS", "HAS_TRITON", "split_partition", "split_bounds", "active_splits", "merge_tile",
           "decode_attention", "decode_attention_ref", "decode_num_splits", "launch_num_splits", "merge_max_splits",
           "decode_tiles", "decode_reduce", "decode_reduce_ref", "active_splits_ref", "merge_splits_ref"]
