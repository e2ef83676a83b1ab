"""Paged decode attention (GQA, split-K merged in the kernel or by a reduce step). How a launch is shaped (tiles,
KV heads a program, split count, merge tile) is kernels/decode_launch.py; the KV-cache writes (alone, or fused with
the rotary embedding of q and k) are kernels/kv_write.py; the varlen prefill over a paged cached prefix is
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

from dataclasses import replace
from typing import Optional

import torch

from deepserve.kernels import HAS_TRITON, cdiv, next_pow2, require_triton, tl, triton
from deepserve.kernels.decode_launch import (DECODE_BLOCK_N, SPLIT_COUNTERS, SPLIT_MERGE, DecodeTiles, decode_tiles,
                                            fits_one_wave, kv_heads_a_program, launch_num_splits, merge_tile,
                                            split_counters)
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
def window_first_key(seq_len, WINDOW: tl.constexpr):
    """The first key a decode row of `seq_len` keys sees: seq_len - WINDOW through a sliding window (WINDOW > 0,
    never below 0), else 0. The splits partition the keys from there (`window_split_bounds`)."""
    first = seq_len * 0
    if WINDOW > 0:
        first = tl.maximum(seq_len - WINDOW, 0)
    return first


@triton.jit
def window_split_bounds(seq_len, split, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
    """`split_bounds` over a sliding window's keys: the splits partition keys window_first_key .. seq_len - 1."""
    first = window_first_key(seq_len, WINDOW)
    start, end = split_bounds(seq_len - first, split, SPLIT, BLOCK_N)
    return first + start, first + end


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
                      SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr = 0):
    """What decode row i's program needs from the step's inputs: (its q row, its sequence, the sequence's length,
    the sequence's block-table row, the block ids of the first tile of split `split`)."""
    row, seq, seq_len = decode_row(q_rows_ptr, seq_ids_ptr, seq_lens_ptr, i)
    table = block_tables_ptr + seq * stride_bt
    start, end = window_split_bounds(seq_len, split, SPLIT, BLOCK_N, WINDOW)
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
                   LATE_TRIGGER: tl.constexpr = False, WINDOW: tl.constexpr = 0):
    """One (decode row, KV_HEADS adjacent KV heads, split). KV_HEADS 2 (DecodeTiles.kv_heads): a tile row holds
    both heads' HEAD_DIM columns side by side (one load of 2 * HEAD_DIM contiguous elements a token), and the q tile
    stacks both heads' query groups, each row zero outside its own head's columns (`_own_columns`): the scores are
    each head's own, and of the [rows, 2 * HEAD_DIM] output each row keeps its own head's half.
    MERGE_LAST (split launches): each program counts itself done in count_ptr's counter of its (row, KV heads), and
    the last of the row's active splits to do so merges them all into `out` (`_merge_own_splits`) and zeroes the
    counter for the next launch: no reduce launch. The order is CUTLASS's semaphore's: every thread's stores, a CTA
    barrier, then one release-acquire atomic at GPU scope; the merge reads the partials after it.
    WINDOW > 0 (a sliding window): a row reads its last WINDOW keys only, the splits partitioning those; 0 (every
    model without one) compiles to the kernel without it."""
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
                                                            stride_bt, i, split, block_size, SPLIT, BLOCK_N, WINDOW)
    pdl_wait_after_inputs(INPUTS_READY, USE_PDL, not LATE_TRIGGER)
    start, end = window_split_bounds(seq_len, split, SPLIT, BLOCK_N, WINDOW)
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
            used = active_splits(seq_len - window_first_key(seq_len, WINDOW), tl.num_programs(2), BLOCK_N)
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
                          PF_PIECES: tl.constexpr, PF_PIECE: tl.constexpr, USE_PDL: tl.constexpr,
                          WINDOW: tl.constexpr = 0):
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
    smask = s < active_splits(seq_len - window_first_key(seq_len, WINDOW), num_splits, BLOCK_N)
    lse = tl.load(part_lse_ptr + i * stride_pl_r + h * stride_pl_h + s, mask=smask, other=float("-inf"))
    lse_max = tl.max(lse, 0)                       # finite: split 0 always holds key 0
    w = tl.math.exp2(lse - lse_max)                 # 0 for empty splits
    o = tl.load(part_out_ptr + i * stride_po_r + h * stride_po_h + s[:, None] * stride_po_s + d[None, :],
                mask=smask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + row * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     scale: float, out: Optional[torch.Tensor] = None, q_rows: Optional[torch.Tensor] = None,
                     seq_ids: Optional[torch.Tensor] = None, max_seq_len: Optional[int] = None,
                     num_splits: Optional[int] = None, inputs_ready: bool = False,
                     tiles: Optional[DecodeTiles] = None, l2_prefetch: Optional[torch.Tensor] = None,
                     split_merge: Optional[str] = None, window: int = 0) -> torch.Tensor:
    """Attention of one query token per sequence over its paged keys.

    q: [T, H, D]; the decode rows are `q_rows` (default: all T rows), row i belonging to sequence `seq_ids[i]`
    (default i) of `block_tables` [B, max_blocks] / `seq_lens` [B]. Writes rows `q_rows` of `out` ([T, H, D],
    allocated when None) and returns it. `max_seq_len` (host int) sizes the split; `num_splits` forces it.
    `inputs_ready`: q_rows, seq_ids, seq_lens and block_tables were in place before the kernel launched just
    before this call (the attention backends' per-step metadata), so they may be read before the PDL wait.
    `tiles` forces the launch settings (tuning); None: `DecodeTiles()`. `l2_prefetch`: the weight read next
    (o_proj's), which a split launch's reduce may ask into L2 (kernels/l2_prefetch.py); it changes no result.
    `split_merge` ("reduce" / "last", default SPLIT_MERGE): how a split launch's partials merge.
    `window` > 0: a sliding window, each row attends to its last `window` keys (the split is sized for at most that).
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
    window = max(0, window)
    if window:
        max_seq_len = min(max_seq_len, window)      # the keys a row reads, which the splits partition
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
        merge = merge_tile(tiles.kv_heads * group, num_splits, d, one_tile=partition == block_n)
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
        LATE_TRIGGER=merge is not None and n > 1, WINDOW=window,
        **(dict(zip(("MERGE_G", "MERGE_S"), merge)) if merge else {}),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **({"maxnreg": tiles.maxnreg} if tiles.maxnreg else {}),
        **pdl_launch_args(q))
    if split and merge is None:
        # The decode kernel, the reduce's predecessor, writes none of the inputs: they are ready for it.
        decode_reduce(part_out, part_lse, q_rows, seq_ids, seq_lens, out, inputs_ready=EARLY_INPUTS,
                      block_n=block_n, l2_prefetch=l2_prefetch, window=window)
    return out


def decode_reduce(part_out: torch.Tensor, part_lse: torch.Tensor, q_rows: torch.Tensor, seq_ids: torch.Tensor,
                  seq_lens: torch.Tensor, out: torch.Tensor, inputs_ready: bool = False,
                  block_n: int = DECODE_BLOCK_N, l2_prefetch: Optional[torch.Tensor] = None,
                  window: int = 0) -> torch.Tensor:
    """Merge the split-K partials of decode row i (normalised outputs part_out [n, H, S, D] float32 and their
    log2-sum-exps part_lse [n, H, S]) into out[q_rows[i]]. Only the splits that hold keys of sequence seq_ids[i]
    (DECODE_BLOCK_N tiles, see `split_partition`) are read. `inputs_ready`, `l2_prefetch` and `window` as in
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
        PF_PIECE=L2_PREFETCH_PIECE, WINDOW=window, num_warps=4, **pdl_launch_args(out))
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


def decode_reduce_ref(part_out, part_lse, q_rows, seq_ids, seq_lens, out, window: int = 0):
    """The PyTorch twin of `decode_reduce`."""
    lens = seq_lens[seq_ids]
    if window > 0:
        lens = lens.clamp(max=window)       # the keys of each row's window
    used = active_splits_ref(lens, part_out.shape[2], DECODE_BLOCK_N)
    out[q_rows] = merge_splits_ref(part_out, part_lse, used).to(out.dtype)
    return out


def decode_attention_ref(q, kv_cache, block_tables, seq_lens, scale, out=None, q_rows=None, seq_ids=None,
                         max_seq_len=None, num_splits=None, window: int = 0):
    """The PyTorch twin: gathers each row's keys (its last `window` ones, window > 0) and runs the reference
    backend's decode attention."""
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
    if window > 0:
        mask &= pos[None, :] >= lens[:, None] - window
    slots = torch.where(mask, slots, 0)
    k_flat = reference.as_bytes(kv_cache[0]).flatten(0, 1)      # fp8 codes gathered as bytes
    v_flat = reference.as_bytes(kv_cache[1]).flatten(0, 1)
    out[q_rows] = reference.masked_decode_attention(q[q_rows], k_flat[slots].view(kv_cache.dtype),
                                                    v_flat[slots].view(kv_cache.dtype), mask, scale)
    return out


__all__ = ["EARLY_INPUTS", "HAS_TRITON", "split_partition", "split_bounds", "active_splits", "decode_attention",
           "decode_attention_ref", "decode_reduce", "decode_reduce_ref", "active_splits_ref", "merge_splits_ref"]
