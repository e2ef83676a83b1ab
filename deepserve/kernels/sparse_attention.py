"""DeepSeek-V4.1 attention kernels (deepinfer.md §2.5, §2.6): the sink softmax over gathered cache slots, and the
indexer's logits. The GPU twins of `kernels/reference/sparse_attention.py` (same signatures, same meaning).

sink_attention_gathered
    One KV head (keys = values = a D-wide latent) shared by all nH query heads, each row with its own list of
    cache slots (the sliding window, then the selected compressed entries), and a per-head sink logit that joins
    the denominator only. A program takes one row and a tile of BLOCK_H heads: each key tile is gathered once and
    used by all of them, as keys (q k^T) and as values (p k), through tl.dot. The online softmax starts from the
    sink (m = sink, l = 1, acc = 0): the sink is then one more "key" with a zero value, and a row whose slots are
    all -1 ends with acc = 0, out = 0, as the twin gives.
    The head tiles of one row are adjacent programs, so they run side by side and the row's keys come from HBM
    once and from L2 for the other tiles. Few rows (batch-1 decode: nH/BLOCK_H programs) are split over their keys
    (flash-decoding): every split starts from m = sink (a finite reference, so an all-masked split is harmless),
    only split 0 counts the sink (l = 1, the others l = 0), and a reduce kernel merges the splits by their
    log-sum-exps.
    Numerics: scores, softmax statistics and the accumulator in float32 (exp2 of log2-scaled scores); half-precision
    inputs give exact products with float32 sums in q k^T, and probabilities rounded to the input dtype for p k
    (flash-attention style); float32 inputs use IEEE float32 products (no TF32) in both.
    The query, each key tile and the accumulator are handled as four column chunks (kernels/mla_decode.py's
    reason: one score product of K = 512 is a chain of 32 dependent MMAs per warp; four chunks make four short
    independent chains).
    H200, CUDA graphs, bf16, 64 heads x 512, 128 + 512 keys a row (sink_attention_chunks_ab_h200.json): 7.9 us at
    1 row, 23 at 16, 45 at 64, 62 at 128, 119 at 256, 3-10% below the one-chunk kernel's 8.8 / 25 / 48 / 64 / 123
    (the twin: 50 / 125 / 344 / - / -). Far from the memory bound at large batches (256 rows gather 168 MB: about
    40 us at 4 TB/s): the tl.dot tiles are small (M = 16-64 heads, N = 32-64 keys) and the [64, 512] float32
    accumulator leaves little room; a FlashMLA-style kernel is the next step if it matters.

index_logits
    I(t, j) = sum_h w[t, h] relu(qi[t, h] . ki[j]). The (row, head) pairs of BLOCK_T rows are the M side of one
    tl.dot against a tile of BLOCK_N keys ([BLOCK_T * Hi, Di] x [Di, BLOCK_N]), so a key tile is read once for
    BLOCK_T rows and the product fills a tensor-core tile even at one row (Hi = 32); relu and the head weights
    are applied to the float32 products, then the heads are summed. Each program keeps its query tile and walks a
    few key tiles. H200, bf16, 32 x 128: 2.2 us for 1 row x 4096 keys, 3.5 for 1 x 32768 (2.4 TB/s of keys), 6.4
    for 4 x 32768, 22.6 for 64 x 8192, 119 for 512 x 8192 (about 290 TFLOP/s); the twin is 7-10x slower.
"""

from __future__ import annotations

import torch

from deepserve.kernels import HAS_TRITON, INTERPRET, cdiv, next_pow2, num_sms, require_triton, tl, triton
from deepserve.kernels.mla_decode import load_columns, store_columns
from deepserve.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait
from deepserve.kernels.reference import sparse_attention as reference

_LOG2E = 1.4426950408889634
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SINK_MAX_HEAD_DIM = 512        # a [BLOCK_H, D] float32 accumulator per program: wider spills
SINK_MIN_SPLIT_TILES = 2       # key tiles per split at least: shorter splits cost more in the reduce than they gain
SINK_MAX_SPLITS = 32
INDEX_MAX_HEAD_DIM = 256


def _on_kernel_device(t: torch.Tensor) -> bool:
    return HAS_TRITON and (t.device.type == "cuda" or INTERPRET)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"      # "tf32" is ignored for half inputs


# --- sink attention ----------------------------------------------------------------------------------------------

def sink_attention_supported(q: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor]],
                             sink: torch.Tensor) -> bool:
    """Whether `sink_attention_gathered` runs the kernel (else it runs the twin): q [T, nH, D] float32 / float16 /
    bfloat16 with D <= 512, on CUDA (or the interpreter); 1 or 2 sources whose caches are [S, D] of q's dtype on
    q's device and whose slots are [T, K] int32/int64; sink [nH]."""
    if not _on_kernel_device(q) or q.dim() != 3 or q.dtype not in _DTYPES:
        return False
    T, nH, D = q.shape
    if not 1 <= D <= SINK_MAX_HEAD_DIM or not 1 <= len(sources) <= 2:
        return False
    if sink.shape != (nH,) or sink.device != q.device:
        return False
    for cache, slots in sources:
        if cache.dim() != 2 or cache.shape[1] != D or cache.dtype != q.dtype or cache.device != q.device:
            return False
        if slots.dim() != 2 or slots.shape[0] != T or slots.dtype not in (torch.int32, torch.int64) \
                or slots.device != q.device:
            return False
    return True


@triton.jit
def _sink_attend_tiles(q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, cache_ptr, stride_c, slots_ptr, stride_sk, n_keys,
                       tile_lo, tile_hi, c, head_dim, qk_scale, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
                       PRECISION: tl.constexpr):
    """Fold key tiles [tile_lo, tile_hi) of one source (slots of one row; -1 or past n_keys: no key) into the
    online-softmax state (m_i, l_i [BLOCK_H], the accumulator's four column chunks a0..a3 [BLOCK_H, CHUNK]), scores
    in the log2 domain. The query and each key tile come in the same four chunks: the score is four independent
    products summed (kernels/mla_decode.py's reason: one chain of 32 dependent MMAs per warp is latency-bound)."""
    for tile in range(tile_lo, tile_hi):
        j = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        slot = tl.load(slots_ptr + j * stride_sk, mask=j < n_keys, other=-1).to(tl.int64)
        ok = slot >= 0
        rows = (cache_ptr + slot * stride_c)[:, None]
        k0 = load_columns(rows, 0 * CHUNK, c, ok, head_dim)
        k1 = load_columns(rows, 1 * CHUNK, c, ok, head_dim)
        k2 = load_columns(rows, 2 * CHUNK, c, ok, head_dim)
        k3 = load_columns(rows, 3 * CHUNK, c, ok, head_dim)
        s = ((tl.dot(q0, tl.trans(k0), input_precision=PRECISION) + tl.dot(q1, tl.trans(k1), input_precision=PRECISION))
             + (tl.dot(q2, tl.trans(k2), input_precision=PRECISION)
                + tl.dot(q3, tl.trans(k3), input_precision=PRECISION))) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))          # >= the sink: finite even when the whole tile is masked
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(k0.dtype)
        a0 = a0 * alpha[:, None] + tl.dot(p, k0, input_precision=PRECISION)
        a1 = a1 * alpha[:, None] + tl.dot(p, k1, input_precision=PRECISION)
        a2 = a2 * alpha[:, None] + tl.dot(p, k2, input_precision=PRECISION)
        a3 = a3 * alpha[:, None] + tl.dot(p, k3, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, a0, a1, a2, a3


@triton.jit
def _sink_attention_kernel(q_ptr, sink_ptr, cache0_ptr, slots0_ptr, cache1_ptr, slots1_ptr, out_ptr,
                           part_out_ptr, part_lse_ptr, qk_scale,
                           stride_qt, stride_qh, stride_c0, stride_s0t, stride_s0k, stride_c1, stride_s1t, stride_s1k,
                           stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
                           num_heads, head_tiles, head_dim, k0, k1, tiles_per_split,
                           TWO_SOURCES: tl.constexpr, BLOCK_H: tl.constexpr, CHUNK: tl.constexpr,
                           BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                           USE_PDL: tl.constexpr):
    pdl_wait(USE_PDL)                   # q and the slots are this step's (kernels/pdl.py)
    pdl_launch_dependents(USE_PDL)
    # Axis 0: (row, head tile), head tiles fastest: a row's tiles run side by side and share its keys through L2.
    pid = tl.program_id(0)
    heads = (pid % head_tiles) * BLOCK_H + tl.arange(0, BLOCK_H)
    t = (pid // head_tiles).to(tl.int64)
    split = tl.program_id(1)
    h_ok = heads < num_heads
    c = tl.arange(0, CHUNK)
    q_rows = q_ptr + t * stride_qt + heads[:, None] * stride_qh
    q0 = load_columns(q_rows, 0 * CHUNK, c, h_ok, head_dim)
    q1 = load_columns(q_rows, 1 * CHUNK, c, h_ok, head_dim)
    q2 = load_columns(q_rows, 2 * CHUNK, c, h_ok, head_dim)
    q3 = load_columns(q_rows, 3 * CHUNK, c, h_ok, head_dim)
    # The sink in the log2 domain; padded heads get 0 (their rows are never stored).
    m_i = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    if SPLIT:
        l_i = tl.where(split == 0, 1.0, 0.0) + tl.zeros([BLOCK_H], tl.float32)    # the sink counts once
    else:
        l_i = tl.full([BLOCK_H], 1.0, tl.float32)
    a0 = tl.zeros([BLOCK_H, CHUNK], tl.float32)
    a1 = tl.zeros([BLOCK_H, CHUNK], tl.float32)
    a2 = tl.zeros([BLOCK_H, CHUNK], tl.float32)
    a3 = tl.zeros([BLOCK_H, CHUNK], tl.float32)

    # Key tiles of the row: source 0's, then source 1's; split s takes tiles [lo, hi) of that sequence.
    tiles0 = tl.cdiv(k0, BLOCK_N)
    tiles1 = tl.cdiv(k1, BLOCK_N)
    if SPLIT:
        lo = split * tiles_per_split
        hi = lo + tiles_per_split
    else:
        lo = 0
        hi = tiles0 + tiles1
    m_i, l_i, a0, a1, a2, a3 = _sink_attend_tiles(
        q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, cache0_ptr, stride_c0, slots0_ptr + t * stride_s0t, stride_s0k,
        k0, lo, tl.minimum(hi, tiles0), c, head_dim, qk_scale, CHUNK, BLOCK_N, PRECISION)
    if TWO_SOURCES:
        m_i, l_i, a0, a1, a2, a3 = _sink_attend_tiles(
            q0, q1, q2, q3, m_i, l_i, a0, a1, a2, a3, cache1_ptr, stride_c1, slots1_ptr + t * stride_s1t,
            stride_s1k, k1, tl.maximum(lo - tiles0, 0), tl.minimum(hi - tiles0, tiles1), c, head_dim, qk_scale,
            CHUNK, BLOCK_N, PRECISION)

    if SPLIT:
        # Normalised partial and its log2-sum-exp; a split without keys (l = 0) has weight 0 in the merge.
        has = l_i > 0
        norm = tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        o_rows = part_out_ptr + t * stride_pt + heads[:, None] * stride_ph + split * stride_ps
        tl.store(part_lse_ptr + t * stride_lt + heads * stride_lh + split, lse, mask=h_ok)
    else:
        norm = l_i[:, None]
        o_rows = out_ptr + t * stride_ot + heads[:, None] * stride_oh
    store_columns(o_rows, 0 * CHUNK, c, h_ok, a0 / norm, head_dim)
    store_columns(o_rows, 1 * CHUNK, c, h_ok, a1 / norm, head_dim)
    store_columns(o_rows, 2 * CHUNK, c, h_ok, a2 / norm, head_dim)
    store_columns(o_rows, 3 * CHUNK, c, h_ok, a3 / norm, head_dim)


@triton.jit
def _sink_reduce_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
                        stride_ot, stride_oh, num_splits, head_dim,
                        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr):
    """out[t, h] = sum_s w_s part[s] / sum_s w_s with w_s = 2^(lse_s - max lse): split 0 holds the sink, so the max
    is finite and the sum positive."""
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    lse = tl.load(part_lse_ptr + t * stride_lt + h * stride_lh + s, mask=s < num_splits, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.exp2(lse - top)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    acc = tl.zeros([BLOCK_D], tl.float32)
    base = part_out_ptr + t * stride_pt + h * stride_ph
    for i in range(0, num_splits):
        w_i = tl.sum(tl.where(s == i, w, 0.0), 0)
        acc += w_i * tl.load(base + i * stride_ps + d, mask=d_ok, other=0.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, acc / tl.sum(w, 0), mask=d_ok)


def sink_config(num_heads: int, head_dim: int, rows: int, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_N, warps). Wide heads (D >= 256), from an H200 sweep at 64 heads x 512, W = 128 + 512 keys,
    bf16 (BLOCK_H 16/32/64 x BLOCK_N 16/32/64 x 4/8 warps x 1-3 stages): 64 heads x 64 keys on 8 warps for many
    rows (256 rows: 130 us, against 237 for 16 x 32 x 4), 32 x 64 on 4 warps from 32 rows (64 rows: 53 us, was 63),
    16 x 32 on 4 warps below (those split over their keys: more, smaller programs; one row: 9 us). Narrow heads: a
    [BLOCK_H, D] float32 accumulator of at most 8K elements, 64-key tiles, 4 warps (not swept). Always at least 16
    heads (tl.dot's M) and never more than the heads there are, rounded up. float32 inputs at D >= 256 keep 16 x 32
    (a [64, 512] float32 key tile, two stages deep, would not fit in shared memory)."""
    block_d = max(16, next_pow2(head_dim))
    heads = max(16, next_pow2(num_heads))
    if block_d >= 256 and dtype == torch.float32:
        return 16, 32, 4
    if block_d >= 256:
        if rows >= 128:
            return min(64, heads), 64, 8
        if rows >= 32:
            return min(32, heads), 64, 4
        return 16, 32, 4
    return max(16, min(64, 8192 // block_d, heads)), 64, 4


def sink_num_splits(rows: int, head_tiles: int, key_tiles: int, device: torch.device) -> int:
    """Key splits per row: enough programs for one wave of the SMs when the rows fill less than half of it, with at
    least SINK_MIN_SPLIT_TILES key tiles per split (the float32 partials cost traffic: [T, nH, splits, D] written and
    read again). Host ints only (no device sync): a CUDA graph's shapes fix it."""
    programs = max(1, rows * head_tiles)
    target = num_sms(device)
    if 2 * programs > target or key_tiles < 2 * SINK_MIN_SPLIT_TILES:     # at least half a wave: no split
        return 1
    return max(1, min(cdiv(target, programs), key_tiles // SINK_MIN_SPLIT_TILES, SINK_MAX_SPLITS))


def sink_attention_gathered(q: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor]], sink: torch.Tensor,
                            scale: float, num_splits: int | None = None, block_h: int | None = None,
                            block_n: int | None = None, num_warps: int | None = None,
                            num_stages: int = 2) -> torch.Tensor:
    """The twin's `sink_attention_gathered`: q [T, nH, D]; sources: 1 or 2 (cache [S, D], slots [T, K] with -1 = no
    key) pairs, keys = values = cache[slot]; sink [nH] -> [T, nH, D] float32, one softmax per (row, head) over the
    row's keys of all sources plus the sink (in the denominator only). Where `sink_attention_supported` is False
    the twin runs. q: any row/head strides; caches: any row stride; slots: any strides (unit last strides are
    copied to where needed). `num_splits` forces the split over keys (else `sink_num_splits`); `block_h`,
    `block_n`, `num_warps`, `num_stages` are tuning knobs."""
    if not sink_attention_supported(q, sources, sink):
        return reference.sink_attention_gathered(q, sources, sink, scale)
    require_triton(q)
    T, nH, D = q.shape
    out = torch.empty(T, nH, D, dtype=torch.float32, device=q.device)
    if T == 0 or nH == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    caches = [c if c.stride(-1) == 1 else c.contiguous() for c, _ in sources]
    slots = [s for _, s in sources]
    two = len(sources) == 2
    if not two:                                  # source 1: empty (never read)
        caches.append(caches[0])
        slots.append(slots[0][:, :0])
    sink = sink.float()
    cfg_h, cfg_n, cfg_w = sink_config(nH, D, T, q.dtype)
    block_h, block_n, warps = block_h or cfg_h, block_n or cfg_n, num_warps or cfg_w
    head_tiles = cdiv(nH, block_h)
    k0, k1 = slots[0].shape[1], slots[1].shape[1]
    key_tiles = cdiv(k0, block_n) + cdiv(k1, block_n)
    if num_splits is None:
        num_splits = sink_num_splits(T, head_tiles, key_tiles, q.device)
    tiles_per_split = cdiv(max(key_tiles, 1), max(1, num_splits))
    num_splits = max(1, cdiv(key_tiles, tiles_per_split))
    split = num_splits > 1
    if split:
        part_out = torch.empty(T, nH, num_splits, D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(T, nH, num_splits, dtype=torch.float32, device=q.device)
        po = (part_out.stride(0), part_out.stride(1), part_out.stride(2))
        pl = (part_lse.stride(0), part_lse.stride(1))
    else:
        part_out = part_lse = out               # unused
        po, pl = (0, 0, 0), (0, 0)
    block_d = max(16, next_pow2(D))
    _sink_attention_kernel[(T * head_tiles, num_splits)](
        q, sink, caches[0], slots[0], caches[1], slots[1], out, part_out, part_lse, float(scale) * _LOG2E,
        q.stride(0), q.stride(1), caches[0].stride(0), slots[0].stride(0), slots[0].stride(1),
        caches[1].stride(0), slots[1].stride(0), slots[1].stride(1), out.stride(0), out.stride(1), *po, *pl,
        nH, head_tiles, D, k0, k1, tiles_per_split,
        TWO_SOURCES=two, BLOCK_H=block_h, CHUNK=max(16, block_d // 4), BLOCK_N=block_n, SPLIT=split,
        PRECISION=_precision(q.dtype), num_warps=warps, num_stages=num_stages, **pdl_launch_args(q))
    if split:
        _sink_reduce_kernel[(T, nH)](
            part_out, part_lse, out, *po, *pl, out.stride(0), out.stride(1), num_splits, D,
            BLOCK_S=max(16, next_pow2(num_splits)), BLOCK_D=block_d, num_warps=4, **pdl_launch_args(q))
    return out


def sink_attention_gathered_ref(q, sources, sink, scale):
    """The PyTorch twin."""
    return reference.sink_attention_gathered(q, sources, sink, scale)


# --- index logits ------------------------------------------------------------------------------------------------

def index_logits_supported(qi: torch.Tensor, w: torch.Tensor, ki: torch.Tensor) -> bool:
    """Whether `index_logits` runs the kernel (else the twin): qi [n, Hi, Di] and ki [N, Di] of one dtype (float32,
    float16, bfloat16), Di <= 256, w [n, Hi] floating, all on one CUDA device (or the interpreter)."""
    if not _on_kernel_device(qi) or qi.dim() != 3 or ki.dim() != 2 or w.dim() != 2:
        return False
    n, hi, di = qi.shape
    if qi.dtype not in _DTYPES or ki.dtype != qi.dtype or not w.dtype.is_floating_point:
        return False
    if ki.shape[1] != di or w.shape != (n, hi) or not 1 <= di <= INDEX_MAX_HEAD_DIM or hi < 1:
        return False
    return ki.device == qi.device and w.device == qi.device


@triton.jit
def _index_logits_kernel(qi_ptr, w_ptr, ki_ptr, out_ptr, n_rows, n_keys, num_heads, head_dim, tiles_per_program,
                         stride_qt, stride_qh, stride_wt, stride_wh, stride_k, stride_ot,
                         BLOCK_T: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                         PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    """Rows [t0, t0 + BLOCK_T) against key tiles [tile0, tile0 + tiles_per_program): the query tile is loaded once
    and the key tiles stream past it (pipelined by num_stages)."""
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    tile0 = tl.program_id(0) * tiles_per_program
    t0 = tl.program_id(1) * BLOCK_T
    # M side: (row, head) pairs, row-major, so the [M, BLOCK_N] product reshapes to [BLOCK_T, BLOCK_HI, BLOCK_N].
    r = tl.arange(0, BLOCK_T * BLOCK_HI)
    t = (t0 + r // BLOCK_HI).to(tl.int64)
    h = r % BLOCK_HI
    r_ok = (t < n_rows) & (h < num_heads)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < head_dim
    q = tl.load(qi_ptr + t[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :],
                mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    w = tl.load(w_ptr + t * stride_wt + h * stride_wh, mask=r_ok, other=0.0).to(tl.float32)
    rows = t0 + tl.arange(0, BLOCK_T)
    out_rows = out_ptr + rows[:, None].to(tl.int64) * stride_ot
    rows_ok = (rows < n_rows)[:, None]
    for tile in range(tile0, tl.minimum(tile0 + tiles_per_program, tl.cdiv(n_keys, BLOCK_N))):
        j = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        j_ok = j < n_keys
        k = tl.load(ki_ptr + j[:, None].to(tl.int64) * stride_k + d[None, :], mask=j_ok[:, None] & d_ok[None, :],
                    other=0.0)
        dots = tl.dot(q, tl.trans(k), input_precision=PRECISION)                # [M, BLOCK_N] float32
        weighted = tl.maximum(dots, 0.0) * w[:, None]                           # padded pairs: w = 0
        logits = tl.sum(tl.reshape(weighted, [BLOCK_T, BLOCK_HI, BLOCK_N]), 1)  # [BLOCK_T, BLOCK_N]
        tl.store(out_rows + j[None, :], logits, mask=rows_ok & j_ok[None, :])


def index_config(n: int, num_heads: int, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_N, warps, stages): up to 128 (row, head) pairs on the M side (Hi = 32: 4 rows; one row at
    n = 1, the decode case, and never below tl.dot's 16), 128-key tiles, 4 warps, 2 stages: the best or near it in
    an H200 sweep (32 x 128 bf16; 32/64/128-key tiles x 4/8 warps x 2-4 stages, 4 or 8 rows a program) from one row
    over 32768 keys (3.6 us, 2.3 TB/s of keys) to 512 rows over 8192 (117 us); 8 rows a program was slower."""
    block_hi = next_pow2(num_heads)
    block_t = max(max(1, 16 // block_hi), min(next_pow2(n), max(1, 128 // block_hi)))
    return block_t, 128, 4, 2


def index_tiles_per_program(key_tiles: int, row_tiles: int, device: torch.device) -> int:
    """Key tiles per program: as many as keep two waves of programs on the SMs (each program loads its query tile
    once), at most 8 (H200: 4-8 tiles a program took 512 rows x 8192 keys from 213 us to 126-138)."""
    return max(1, min(8, key_tiles * row_tiles // (2 * num_sms(device))))


def index_logits(qi: torch.Tensor, w: torch.Tensor, ki: torch.Tensor, block_t: int | None = None,
                 block_n: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
                 tiles_per_program: int | None = None) -> torch.Tensor:
    """The twin's `index_logits`: qi [n, Hi, Di], w [n, Hi], ki [N, Di] -> [n, N] float32,
    I(t, j) = sum_h w[t, h] relu(qi[t, h] . ki[j]). Where `index_logits_supported` is False the twin runs. Any
    row/head strides (unit last strides, else copied); the keyword arguments are tuning knobs."""
    if not index_logits_supported(qi, w, ki):
        return reference.index_logits(qi, w, ki)
    require_triton(qi)
    n, hi, di = qi.shape
    N = ki.shape[0]
    out = torch.empty(n, N, dtype=torch.float32, device=qi.device)
    if n == 0 or N == 0:
        return out
    if qi.stride(-1) != 1:
        qi = qi.contiguous()
    if ki.stride(-1) != 1:
        ki = ki.contiguous()
    cfg_t, cfg_n, cfg_w, cfg_s = index_config(n, hi, di)
    block_t, block_n = block_t or cfg_t, block_n or cfg_n
    block_hi = next_pow2(hi)
    block_t = max(block_t, max(1, 16 // block_hi))          # tl.dot needs M >= 16
    key_tiles, row_tiles = cdiv(N, block_n), cdiv(n, block_t)
    per_program = tiles_per_program or index_tiles_per_program(key_tiles, row_tiles, qi.device)
    _index_logits_kernel[(cdiv(key_tiles, per_program), row_tiles)](
        qi, w, ki, out, n, N, hi, di, per_program, qi.stride(0), qi.stride(1), w.stride(0), w.stride(1),
        ki.stride(0), out.stride(0), BLOCK_T=block_t, BLOCK_HI=block_hi, BLOCK_D=max(16, next_pow2(di)),
        BLOCK_N=block_n, PRECISION=_precision(qi.dtype), num_warps=num_warps or cfg_w,
        num_stages=num_stages or cfg_s, **pdl_launch_args(qi))
    return out


def index_logits_ref(qi, w, ki):
    """The PyTorch twin."""
    return reference.index_logits(qi, w, ki)


__all__ = ["index_config", "index_logits", "index_logits_ref", "index_logits_supported", "index_tiles_per_program",
           "sink_attention_gathered", "sink_attention_gathered_ref", "sink_attention_supported", "sink_config", "sink_num_splits",
           "SINK_MAX_HEAD_DIM", "INDEX_MAX_HEAD_DIM"]
