"""Multi-head latent attention prefill (DeepSeek-V2/V3) for every prefill sequence of a step at once.

The expanded form of deepserve/layers/mla.py's `expanded_attention`, batched: the visible latents [c | k_pe] of
all prefill sequences (cached prefix + this step's tokens) are gathered from the paged cache a block at a time,
expanded by ONE GEMM through kv_b_proj into per-head k_nope and v, and a varlen causal flash-attention kernel
runs each sequence's new query rows over its own keys, with the prefix offset (query i of a chunk that starts
at position p sees keys 0 .. p + i).

The kernel reads the pieces where they lie, without packing them into per-head keys/values first: q_nope and
q_pe (strided views of the projections), k_nope and v from the GEMM's output [keys, H, nope + v], and k_pe from
the gathered latents (one row per token, shared by every head). A score is q_nope.k_nope + q_pe.k_pe.

Gathered rows: each prefill sequence takes whole cache blocks, one sequence after another; rows past a
sequence's length are never read. Sequences are grouped so that a group's visible tokens stay within
max(step tokens, longest prefill context): the expanded keys and values of a chunk over a long prefix are
O(context x heads), and a step with several such chunks must not multiply the peak memory (one group, one
gather + GEMM + launch, in the usual case).

Numerics: scores, softmax statistics and the accumulator in float32; probabilities cast to the value dtype for
P @ V; IEEE float32 products for float32 inputs (no TF32); the output rounded once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepserve.kernels import next_pow2, require_triton, tl, triton
from deepserve.kernels.reference.attention import gather_blocks

_LOG2E = 1.4426950408889634
MLA_PREFILL_BLOCK_M = 64     # query rows per program
MLA_PREFILL_BLOCK_N = 64     # keys per inner step


# --- the kernel -----------------------------------------------------------------------------------

@triton.jit
def _attend_tile(acc, m_i, l_i, q_nope, q_pe, kv_ptr, k_pe_ptr, key0, n0, hi, q_pos, qk_scale,
                 stride_kvt, stride_kpt,
                 NOPE: tl.constexpr, ROPE: tl.constexpr, VDIM: tl.constexpr, BLOCK_NOPE: tl.constexpr,
                 BLOCK_ROPE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                 PRECISION: tl.constexpr):
    """One online-softmax step over keys n0 .. n0 + BLOCK_N (those below `hi`) of one head.
    kv_ptr points at this head's [k_nope | v] in the key row `key0`; k_pe_ptr at that row's k_pe."""
    tok = n0 + tl.arange(0, BLOCK_N)
    t_ok = tok < hi
    rows = (key0 + tok).to(tl.int64)
    dn = tl.arange(0, BLOCK_NOPE)
    dp = tl.arange(0, BLOCK_ROPE)
    dv = tl.arange(0, BLOCK_V)
    k_nope = tl.load(kv_ptr + rows[:, None] * stride_kvt + dn[None, :],
                     mask=t_ok[:, None] & (dn < NOPE)[None, :], other=0.0)
    k_pe = tl.load(k_pe_ptr + rows[:, None] * stride_kpt + dp[None, :],
                   mask=t_ok[:, None] & (dp < ROPE)[None, :], other=0.0)
    s = tl.dot(q_nope, tl.trans(k_nope), input_precision=PRECISION)            # [BLOCK_M, BLOCK_N]
    s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=PRECISION)
    s = s * qk_scale                                                            # log2 domain
    if CAUSAL:
        s = tl.where(t_ok[None, :] & (tok[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(kv_ptr + NOPE + rows[:, None] * stride_kvt + dv[None, :],
                mask=t_ok[:, None] & (dv < VDIM)[None, :], other=0.0)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return acc, m_new, l_i


# Per-step index tensors (views into packed buffers: their 16-byte alignment changes from step to step) are only
# read as scalars: not specialised on, so no new variant compiles mid-serving.
@triton.jit(do_not_specialize=["query_start_ptr", "seq_lens_ptr", "key_start_ptr", "tile_seq_ptr", "tile_m0_ptr"])
def _mla_prefill_kernel(q_nope_ptr, q_pe_ptr, kv_ptr, k_pe_ptr, out_ptr,
                        query_start_ptr, seq_lens_ptr, key_start_ptr, tile_seq_ptr, tile_m0_ptr,
                        qk_scale,
                        stride_qnt, stride_qnh, stride_qpt, stride_qph, stride_kvt, stride_kvh, stride_kpt,
                        stride_ot, stride_oh,
                        NOPE: tl.constexpr, ROPE: tl.constexpr, VDIM: tl.constexpr, BLOCK_NOPE: tl.constexpr,
                        BLOCK_ROPE: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    h = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile).to(tl.int64)
    m0 = tl.load(tile_m0_ptr + tile).to(tl.int32)
    q_start = tl.load(query_start_ptr + seq).to(tl.int32)
    n = tl.load(query_start_ptr + seq + 1).to(tl.int32) - q_start
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    key0 = tl.load(key_start_ptr + seq)
    ctx = seq_len - n

    i = m0 + tl.arange(0, BLOCK_M)
    i_ok = i < n
    q_rows = (q_start + i).to(tl.int64)
    q_pos = ctx + i
    dn = tl.arange(0, BLOCK_NOPE)
    dp = tl.arange(0, BLOCK_ROPE)
    dv = tl.arange(0, BLOCK_V)
    q_nope = tl.load(q_nope_ptr + q_rows[:, None] * stride_qnt + h * stride_qnh + dn[None, :],
                     mask=i_ok[:, None] & (dn < NOPE)[None, :], other=0.0)
    q_pe = tl.load(q_pe_ptr + q_rows[:, None] * stride_qpt + h * stride_qph + dp[None, :],
                   mask=i_ok[:, None] & (dp < ROPE)[None, :], other=0.0)

    kv_head = kv_ptr + h * stride_kvh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    # Keys below ctx + m0 are visible to every query of the tile: no causal mask.
    full_end = ((ctx + m0) // BLOCK_N) * BLOCK_N
    hi = tl.minimum(seq_len, ctx + m0 + BLOCK_M)
    for n0 in range(0, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q_nope, q_pe, kv_head, k_pe_ptr, key0, n0, full_end, q_pos,
                                     qk_scale, stride_kvt, stride_kpt, NOPE, ROPE, VDIM, BLOCK_NOPE, BLOCK_ROPE,
                                     BLOCK_V, BLOCK_N, False, PRECISION)
    # The diagonal band: every row sees key full_end (<= ctx + m0) in its first tile here, so its running max is
    # finite from then on and fully masked later tiles leave it unchanged.
    for n0 in range(full_end, hi, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q_nope, q_pe, kv_head, k_pe_ptr, key0, n0, hi, q_pos,
                                     qk_scale, stride_kvt, stride_kpt, NOPE, ROPE, VDIM, BLOCK_NOPE, BLOCK_ROPE,
                                     BLOCK_V, BLOCK_N, True, PRECISION)
    o = acc / l_i[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + dv[None, :], o.to(out_ptr.dtype.element_ty),
             mask=i_ok[:, None] & (dv < VDIM)[None, :])


def mla_prefill_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, k_pe: torch.Tensor,
                          out: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                          key_start: torch.Tensor, tile_seq: torch.Tensor, tile_m0: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """Causal attention of the tiled sequences' query rows over their expanded keys; writes their rows of `out`.

    q_nope [T, H, nope], q_pe [T, H, rope]: the step's queries (any row/head strides, unit last stride);
    kv [N, H, nope + v]: k_nope then v per head of N gathered key rows; k_pe [N, rope] (any row stride);
    out [T, H, v]. Sequence b (batch index) owns query rows query_start_loc[b] .. [b + 1] and its keys
    0 .. seq_lens[b] - 1 are the rows key_start[b] + j. tile_seq / tile_m0: one entry per
    MLA_PREFILL_BLOCK_M query rows (its sequence, its first row within it).
    """
    require_triton(q_nope)
    heads, nope = q_nope.shape[1], q_nope.shape[2]
    rope, v_dim = q_pe.shape[-1], out.shape[-1]
    assert kv.shape[1:] == (heads, nope + v_dim) and k_pe.shape[-1] == rope
    assert q_nope.stride(-1) == q_pe.stride(-1) == kv.stride(-1) == k_pe.stride(-1) == out.stride(-1) == 1
    if tile_seq.shape[0] == 0:
        return out
    precision = "ieee" if q_nope.dtype == torch.float32 else "tf32"     # float32 inputs: no TF32 rounding
    _mla_prefill_kernel[(heads, tile_seq.shape[0])](
        q_nope, q_pe, kv, k_pe, out, query_start_loc, seq_lens, key_start, tile_seq, tile_m0,
        scale * _LOG2E,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), kv.stride(0), kv.stride(1),
        k_pe.stride(0), out.stride(0), out.stride(1),
        NOPE=nope, ROPE=rope, VDIM=v_dim, BLOCK_NOPE=max(16, next_pow2(nope)), BLOCK_ROPE=max(16, next_pow2(rope)),
        BLOCK_V=max(16, next_pow2(v_dim)), BLOCK_M=MLA_PREFILL_BLOCK_M, BLOCK_N=MLA_PREFILL_BLOCK_N,
        PRECISION=precision, num_warps=4, num_stages=2)
    return out


# --- the per-step plan ----------------------------------------------------------------------------

@dataclass
class PrefillGroup:
    """Prefill sequences gathered, expanded and attended together (device tensors, shared by every layer)."""
    key_blocks: torch.Tensor     # [num_blocks] cache blocks to gather: each sequence's visible blocks, in order
    tile_seq: torch.Tensor       # [tiles] batch index of the sequence of each MLA_PREFILL_BLOCK_M query rows
    tile_m0: torch.Tensor        # [tiles] the tile's first query row within its sequence


@dataclass
class PrefillLayout:
    """The host half of the plan: plain int lists, uploaded with the step's other index lists in one copy."""
    key_start: list[int]                                   # [B] first gathered row of sequence b in its group
    groups: list[tuple[list[int], list[int], list[int], list[int]]]   # (block seq, block index, tile seq, m0)

    def parts(self) -> list[list[int]]:
        return [self.key_start] + [part for group in self.groups for part in group]

    def on_device(self, views: list[torch.Tensor], block_tables: torch.Tensor) -> MLAPrefillPlan:
        """`views`: the uploaded `parts()`, in order. Looks the cache blocks up in the step's block tables."""
        key_start, rest = views[0], views[1:]
        groups = []
        for g in range(len(self.groups)):
            block_seq, block_idx, tile_seq, tile_m0 = rest[4 * g: 4 * g + 4]
            groups.append(PrefillGroup(block_tables[block_seq, block_idx], tile_seq, tile_m0))
        return MLAPrefillPlan(key_start, groups)


@dataclass
class MLAPrefillPlan:
    key_start: torch.Tensor      # [B] int64
    groups: list[PrefillGroup]


def plan_prefill(query_lens: list[int], seq_lens: list[int], block_size: int) -> PrefillLayout:
    """Group the prefill sequences (query length > 1) and lay out their gathered keys and query tiles."""
    prefills = [b for b, n in enumerate(query_lens) if n > 1]
    budget = max([sum(query_lens)] + [seq_lens[b] for b in prefills])
    key_start = [0] * len(query_lens)
    groups, members, tokens = [], [], 0
    for b in prefills:
        if members and tokens + seq_lens[b] > budget:
            groups.append(_group_layout(members, query_lens, seq_lens, block_size, key_start))
            members, tokens = [], 0
        members.append(b)
        tokens += seq_lens[b]
    if members:
        groups.append(_group_layout(members, query_lens, seq_lens, block_size, key_start))
    return PrefillLayout(key_start, groups)


def _group_layout(members, query_lens, seq_lens, block_size, key_start):
    """(block seq, block index, tile seq, tile m0) lists of one group; fills key_start of its members."""
    block_seq, block_idx, tiles = [], [], []
    for b in members:
        key_start[b] = len(block_seq) * block_size
        blocks = -(-seq_lens[b] // block_size)
        block_seq += [b] * blocks
        block_idx += range(blocks)
        ctx = seq_lens[b] - query_lens[b]
        tiles += [(ctx + m0, b, m0) for m0 in range(0, query_lens[b], MLA_PREFILL_BLOCK_M)]
    # Tiles that see the most keys (late rows, long prefixes) first, so the heaviest programs start early.
    tiles.sort(key=lambda e: -e[0])
    return block_seq, block_idx, [b for _, b, _ in tiles], [m0 for _, _, m0 in tiles]


# --- per layer ------------------------------------------------------------------------------------

def mla_prefill(q_nope, q_pe, kv_cache, kv_b: torch.Tensor, plan: MLAPrefillPlan, query_start_loc, seq_lens,
                scale: float, out: torch.Tensor) -> torch.Tensor:
    """Every prefill row of a step (their latents already in the cache): writes those rows of out [T, H, v].
    kv_cache [num_blocks, block_size, r + rope]; kv_b [H * (nope + v), r] (MLAWeights.stacked())."""
    heads, rank = q_nope.shape[1], kv_b.shape[1]
    for group in plan.groups:
        keys = gather_blocks(kv_cache, group.key_blocks).view(-1, kv_cache.shape[-1])  # [N, r + rope]
        keys = keys.to(kv_b.dtype)                                  # an fp8 cache's codes widen here
        kv = F.linear(keys[:, :rank], kv_b).view(keys.shape[0], heads, -1)            # [N, H, nope + v]
        mla_prefill_attention(q_nope, q_pe, kv, keys[:, rank:], out, query_start_loc, seq_lens, plan.key_start,
                              group.tile_seq, group.tile_m0, scale)
    return out


__all__ = ["MLA_PREFILL_BLOCK_M", "MLAPrefillPlan", "PrefillGroup", "PrefillLayout", "mla_prefill",
           "mla_prefill_attention", "plan_prefill"]
