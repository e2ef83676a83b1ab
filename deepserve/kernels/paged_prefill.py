"""Paged attention prefill: varlen query rows over each sequence's paged keys (flash-attention style, causal with
an offset). Query i of a sequence with n new tokens and seq_len keys sits at position seq_len - n + i and sees keys
0 .. that position: whole prompts, prompts over a cached prefix, and chunks, in one launch.

KV cache of one layer as in kernels/paged_attention.py: [2, num_blocks, block_size, num_kv_heads, head_dim].
The launcher has a PyTorch twin with the same signature (`prefill_attention_ref`), built from the reference
backend's per-sequence prefill. Numerics: scores, softmax statistics and accumulators in float32; probabilities cast
to the value dtype for the P @ V product; the output rounded once to the query dtype. Keys and values of an 8-bit
float cache are widened to the query's dtype as they load.
"""

from typing import Optional

import torch

from deepserve.kernels import next_pow2, require_triton, tl, triton
from deepserve.kernels.kv_rounding import widen_keys, widen_values
from deepserve.kernels.reference import attention as reference

_LOG2E = 1.4426950408889634
PREFILL_BLOCK_M = 64


@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(q_ptr, cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
                    tile_seq_ptr, tile_m0_ptr,
                    qk_scale,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_c_kv, stride_c_block, stride_c_slot, stride_c_head,
                    stride_bt, block_size, group,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    WINDOW: tl.constexpr = 0):
    """One (query head, tile of BLOCK_M query rows of one sequence). WINDOW > 0 (a sliding window): query i sees
    keys q_pos - WINDOW < j <= q_pos, and the tile's keys start at its first query's first."""
    h = tl.program_id(0)
    tile = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile).to(tl.int64)
    m0 = tl.load(tile_m0_ptr + tile).to(tl.int32)
    q_start = tl.load(query_start_ptr + seq).to(tl.int32)
    n = tl.load(query_start_ptr + seq + 1).to(tl.int32) - q_start
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    ctx = seq_len - n
    kvh = h // group

    i = m0 + tl.arange(0, BLOCK_M)
    imask = i < n
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    rows = (q_start + i).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=imask[:, None] & dmask[None, :], other=0.0)
    q_pos = ctx + i

    k_base = cache_ptr + kvh * stride_c_head
    v_base = k_base + stride_c_kv
    table = block_tables_ptr + seq * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    first_pos = ctx + m0
    # Keys below full_end are at or before every query of the tile: no causal mask, no bounds mask.
    full_end = (first_pos // BLOCK_N) * BLOCK_N
    hi = tl.minimum(seq_len, ctx + m0 + BLOCK_M)
    if WINDOW > 0:
        # Through a window the tile's keys start at its first query's first (lo, down to a tile). Those visible to
        # every query (from its last query's first) need no mask either; the ones below them do.
        lo = (tl.maximum(first_pos - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
        every_row = tl.cdiv(tl.maximum(hi - WINDOW, 0), BLOCK_N) * BLOCK_N
        mid = tl.maximum(tl.minimum(every_row, full_end), lo)
        m_i, l_i, acc = _masked_key_tiles(q, k_base, v_base, table, m_i, l_i, acc, q_pos, d, dmask, lo, mid, hi,
                                          block_size, stride_c_block, stride_c_slot, qk_scale, WINDOW, BLOCK_N)
    else:
        mid = 0
    m_i, l_i, acc = _unmasked_key_tiles(q, k_base, v_base, table, m_i, l_i, acc, d, dmask, mid, full_end, block_size,
                                        stride_c_block, stride_c_slot, qk_scale, BLOCK_N)
    # The diagonal band: causal mask (without a window key 0 is visible to every row, so no row is ever all -inf
    # here at its first tile, and later fully masked tiles leave m_i unchanged).
    m_i, l_i, acc = _masked_key_tiles(q, k_base, v_base, table, m_i, l_i, acc, q_pos, d, dmask, full_end, hi, hi,
                                      block_size, stride_c_block, stride_c_slot, qk_scale, WINDOW, BLOCK_N)

    o = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=imask[:, None] & dmask[None, :])


@triton.jit
def _unmasked_key_tiles(q, k_base, v_base, table, m_i, l_i, acc, d, dmask, lo, end, block_size, stride_c_block,
                        stride_c_slot, qk_scale, BLOCK_N: tl.constexpr):
    """Fold keys lo .. end - 1 (whole BLOCK_N tiles, each visible to every query of the tile) into the running
    softmax state (m_i, l_i, acc)."""
    for n0 in range(lo, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        blk = tl.load(table + tok // block_size).to(tl.int64)
        off = blk * stride_c_block + (tok % block_size).to(tl.int64) * stride_c_slot
        k = widen_keys(tl.load(k_base + off[:, None] + d[None, :], mask=dmask[None, :], other=0.0), q.dtype)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = widen_values(tl.load(v_base + off[:, None] + d[None, :], mask=dmask[None, :], other=0.0), q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _masked_key_tiles(q, k_base, v_base, table, m_i, l_i, acc, q_pos, d, dmask, lo, end, hi, block_size,
                      stride_c_block, stride_c_slot, qk_scale, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """Fold keys lo .. end - 1 (BLOCK_N tiles, none at or past `hi`) into the running state, each query seeing the
    keys at or before its position q_pos, and through a window (WINDOW > 0) after q_pos - WINDOW. Through a window a
    row may see no key of a tile before its first: its maximum stays -inf there, so the rescaling uses 0 in its
    place (exp2(-inf - 0) = 0: nothing added, nothing lost)."""
    for n0 in range(lo, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        tmask = tok < hi
        blk = tl.load(table + tok // block_size, mask=tmask, other=0).to(tl.int64)
        off = blk * stride_c_block + (tok % block_size).to(tl.int64) * stride_c_slot
        kv_mask = tmask[:, None] & dmask[None, :]
        k = widen_keys(tl.load(k_base + off[:, None] + d[None, :], mask=kv_mask, other=0.0), q.dtype)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        visible = tmask[None, :] & (tok[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            visible = visible & (tok[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
        if WINDOW > 0:
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = widen_values(tl.load(v_base + off[:, None] + d[None, :], mask=kv_mask, other=0.0), q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return m_i, l_i, acc


def prefill_tiles(query_lens: list, seqs: list, device: torch.device,
                  block_m: int = PREFILL_BLOCK_M) -> tuple:
    """(tile_seq, tile_m0) int32 tensors: one entry per BLOCK_M query rows of each listed sequence, longest
    sequences' last tiles (the most keys) first so the heavy programs start early."""
    entries = []
    for b in seqs:
        n = query_lens[b]
        for m0 in range(0, n, block_m):
            entries.append((b, m0))
    entries.sort(key=lambda e: -(e[1]))
    tile_seq = torch.tensor([e[0] for e in entries], dtype=torch.int32)
    tile_m0 = torch.tensor([e[1] for e in entries], dtype=torch.int32)
    return tile_seq.to(device, non_blocking=True), tile_m0.to(device, non_blocking=True)


def prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, scale: float, tile_seq: torch.Tensor, tile_m0: torch.Tensor,
                      out: Optional[torch.Tensor] = None, num_warps: Optional[int] = None,
                      window: int = 0) -> torch.Tensor:
    """Causal attention of each tiled sequence's query rows over its paged keys (cached prefix + new tokens,
    already written to the cache); through a sliding window of `window` keys where window > 0. Tiles come from
    `prefill_tiles` (BLOCK_M = PREFILL_BLOCK_M); rows of sequences without tiles are left untouched in `out`."""
    require_triton(q)
    t, h, d = q.shape
    hkv = kv_cache.shape[3]
    assert h % hkv == 0 and kv_cache.shape[4] == d and q.stride(-1) == 1 and kv_cache.stride(-1) == 1
    if out is None:
        out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    num_tiles = tile_seq.shape[0]
    if num_tiles == 0:
        return out
    block_d = next_pow2(d)
    _prefill_kernel[(h, num_tiles)](
        q, kv_cache, out, block_tables, seq_lens, query_start_loc, tile_seq, tile_m0,
        scale * _LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0), kv_cache.shape[2], h // hkv,
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=64 if block_d <= 128 else 32,
        WINDOW=max(0, window), num_warps=num_warps or 4, num_stages=2)
    return out


def prefill_attention_ref(q, kv_cache, block_tables, seq_lens, query_start_loc, scale, tile_seq=None, tile_m0=None,
                          out=None, seqs: Optional[list] = None, window: int = 0):
    """The PyTorch twin: the reference backend's per-sequence prefill attention (sequences `seqs`, default all
    sequences with a tile, or all)."""
    if out is None:
        out = torch.empty_like(q)
    bs = kv_cache.shape[2]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    if seqs is None:
        seqs = sorted(set(tile_seq.tolist())) if tile_seq is not None else list(range(len(lens)))
    k_flat = reference.as_bytes(kv_cache[0]).flatten(0, 1)      # fp8 codes gathered as bytes
    v_flat = reference.as_bytes(kv_cache[1]).flatten(0, 1)
    for b in seqs:
        n, seq_len = starts[b + 1] - starts[b], lens[b]
        pos = torch.arange(seq_len, device=q.device)
        slots = block_tables[b, pos // bs] * bs + pos % bs
        rows = slice(starts[b], starts[b + 1])
        out[rows] = reference.causal_prefill_attention(q[rows], k_flat[slots].view(kv_cache.dtype),
                                                       v_flat[slots].view(kv_cache.dtype), seq_len - n, scale,
                                                       window)
    return out


__all__ = ["PREFILL_BLOCK_M", "prefill_tiles", "prefill_attention", "prefill_attention_ref"]
