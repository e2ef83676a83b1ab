"""Fused mixture-of-experts kernels: the GPU twin of `TorchMoE` (deepserve/layers/moe.py).

Three steps, fixed shapes and no host sync (CUDA-graph friendly); four launches at decode sizes:
  align     (token, slot) pairs grouped by expert, each expert's run padded to a multiple of BLOCK_M rows, so
            every BLOCK_M rows of the sorted list belong to one expert (`moe_align`: one program for small
            batches; for big ones a counter memset, an atomic count and a place kernel; `moe_align_ref` is
            its torch twin).
  gate/up   grouped GEMM: block of sorted rows x w13[expert]^T, gate and up tiles in the same program, the
            SwiGLU (with DeepSeek-V4.1's clamp) in the epilogue -> one [rows, I] activation, never [rows, 2I].
  down      grouped GEMM with w2[expert]; the epilogue multiplies by the router weight and writes each pair's
            row; a combine kernel sums a token's top-k rows in slot order (fixed order: a token's result does
            not depend on what else is in the batch).

Only blocks of experts that got tokens do any work, so a batch-1 decode step reads top_k experts' weights and
nothing else. Inputs bf16/fp16/fp32; products accumulate in float32 (fp32 inputs use IEEE products, not TF32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from deepserve.kernels import cdiv, next_pow2, require_triton, tl, triton

_ALIGN_CELLS = 8192      # one-hot cells [pairs, experts] per align program: bounds its registers


# ------------------------------------------------------------------------------------------------
# Align: sort pairs by expert, pad each expert's run to BLOCK_M
# ------------------------------------------------------------------------------------------------
@dataclass
class MoEAlignment:
    sorted_pairs: torch.Tensor   # [max_rows] int32: pair (token * top_k + slot) of each row; num_pairs = padding
    block_expert: torch.Tensor   # [max_rows / block_m] int32: expert of each block of rows; -1 = unused block
    block_m: int
    num_pairs: int

    @property
    def num_blocks(self) -> int:
        return int(self.block_expert.shape[0])


def align_max_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """A static bound on the padded rows (no host sync): each expert that got a pair pads < block_m rows, and at
    most min(pairs, experts) experts got one."""
    rows = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return cdiv(rows, block_m) * block_m


@triton.jit(do_not_specialize=["num_pairs"])   # the batch size: no new variant per step
def _align_count_kernel(ids_ptr, counts_ptr, rank_ptr, num_pairs, CHUNK: tl.constexpr):
    """counts[e] = pairs routed to e; rank[p] = pair p's place among them (an atomic's old value: the order
    inside an expert's run is arbitrary, which no result depends on, as GEMM rows are independent)."""
    p = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ok = p < num_pairs
    ids = tl.load(ids_ptr + p, mask=ok, other=0).to(tl.int32)
    rank = tl.atomic_add(counts_ptr + ids, tl.full([CHUNK], 1, tl.int32), mask=ok, sem="relaxed")
    tl.store(rank_ptr + p, rank, mask=ok)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])   # the batch size: no new variant per step
def _align_place_kernel(ids_ptr, counts_ptr, rank_ptr, sorted_pairs_ptr, block_expert_ptr,
                        num_pairs, num_experts, num_blocks,
                        BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                        COUNT_HERE: tl.constexpr):
    """Every program rebuilds the (tiny) run layout from the counts, then places its chunk of pairs and labels
    its chunk of blocks with their expert; program 0 also fills the padding rows. COUNT_HERE (one program
    holding every pair: small decode batches) counts and ranks in registers instead, so the whole align is
    one launch."""
    pid = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    p = pid * CHUNK + tl.arange(0, CHUNK)
    p_ok = p < num_pairs
    ids = tl.load(ids_ptr + p, mask=p_ok, other=-1).to(tl.int32)
    onehot = ids[:, None] == e[None, :]                          # [CHUNK, BLOCK_E]
    if COUNT_HERE:
        hits = onehot.to(tl.int32)
        counts = tl.sum(hits, 0)
        rank = tl.sum((tl.cumsum(hits, 0) - hits) * hits, 1)      # earlier pairs of the same expert
    else:
        counts = tl.load(counts_ptr + e, mask=e_ok, other=0)
        rank = tl.load(rank_ptr + p, mask=p_ok, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_end = tl.cumsum(padded, 0)
    run_start = run_end - padded
    # Pairs: row = start of the expert's run + rank (a one-hot select stands in for a register gather).
    start = tl.sum(tl.where(onehot, run_start[None, :], 0), 1)
    tl.store(sorted_pairs_ptr + start + rank, p, mask=p_ok)
    # Blocks: the expert is the number of runs that end at or before the block's first row.
    b = pid * CHUNK + tl.arange(0, CHUNK)
    owner = tl.sum(((run_end[None, :] <= b[:, None] * BLOCK_M) & e_ok[None, :]).to(tl.int32), 1)
    tl.store(block_expert_ptr + b, tl.where(owner < num_experts, owner, -1), mask=b < num_blocks)
    # Padding: the rows after each expert's pairs up to the end of its run (rows past every run stay
    # unwritten: their blocks are marked -1 and never read).
    if pid == 0:
        pad = tl.full([BLOCK_E], 0, tl.int32) + num_pairs
        for j in range(0, BLOCK_M - 1):
            tl.store(sorted_pairs_ptr + run_start + counts + j, pad, mask=e_ok & (counts + j < padded))


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Pairs of `topk_ids` [T, k] grouped by expert, each expert's run padded to a multiple of block_m. Fixed
    shapes, no host sync (CUDA-graph friendly): one launch when a single program holds every pair and block
    (decode), else three (a counter memset, an atomic count, the place kernel)."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    max_rows = align_max_rows(num_pairs, num_experts, block_m)
    num_blocks = max_rows // block_m
    sorted_pairs = torch.empty(max_rows, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    block_e = max(16, next_pow2(num_experts))
    chunk = max(16, min(128, _ALIGN_CELLS // block_e))
    one_program = num_pairs <= chunk and num_blocks <= chunk
    if one_program:
        counts = rank = sorted_pairs     # unused
    else:
        counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
        rank = torch.empty(num_pairs, dtype=torch.int32, device=device)
        _align_count_kernel[(cdiv(num_pairs, chunk),)](flat, counts, rank, num_pairs, CHUNK=chunk, num_warps=4)
    grid = max(cdiv(num_pairs, chunk), cdiv(num_blocks, chunk))
    _align_place_kernel[(grid,)](flat, counts, rank, sorted_pairs, block_expert, num_pairs, num_experts,
                                 num_blocks, BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk,
                                 COUNT_HERE=one_program, num_warps=4)
    return MoEAlignment(sorted_pairs, block_expert, block_m, num_pairs)


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """The torch twin (a stable sort): same runs and blocks; within a run, pairs in increasing order, and
    rows past every run filled with padding."""
    flat_ids = topk_ids.reshape(-1)
    num_pairs = flat_ids.numel()
    device = flat_ids.device
    max_rows = align_max_rows(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.index_add_(0, flat_ids, torch.ones_like(flat_ids))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat_ids, stable=True)
    expert = flat_ids[order]
    rank = torch.arange(num_pairs, device=device) - count_start[expert]
    sorted_pairs = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[(padded_end - padded)[expert] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, max_rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return MoEAlignment(sorted_pairs, block_expert, block_m, num_pairs)


# ------------------------------------------------------------------------------------------------
# Grouped GEMMs
# ------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["num_pairs"])   # the batch size: no new variant per step
def _gate_up_kernel(x_ptr, w13_ptr, act_ptr, sorted_pairs_ptr, block_expert_ptr,
                    num_pairs, top_k, inter, hidden, limit,
                    stride_xt, stride_we, stride_wn, stride_am,
                    HAS_LIMIT: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """act[row, n] = silu(x[token] . w13[e, n]) * (x[token] . w13[e, I + n]) for one block of sorted rows."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_ok = pairs < num_pairs
    tokens = (pairs // top_k).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tokens[:, None] * stride_xt + k[None, :]
    # [BLOCK_K, BLOCK_N] tiles of w13[e]^T: gate rows n, up rows I + n.
    g_ptrs = w13_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn + k[:, None]
    u_ptrs = g_ptrs + inter * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = k < hidden - k0
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        acc_g = tl.dot(a, tl.load(g_ptrs, mask=w_mask, other=0.0), acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, tl.load(u_ptrs, mask=w_mask, other=0.0), acc_u, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if HAS_LIMIT:   # DeepSeek-V4.1: gate clamped from above, up on both sides (as swiglu_activation)
        acc_g = tl.minimum(acc_g, limit)
        acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    dst = act_ptr + rows[:, None].to(tl.int64) * stride_am + n[None, :]
    tl.store(dst, act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])   # the batch size: no new variant per step
def _down_kernel(act_ptr, w2_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, weights_ptr,
                 num_pairs, hidden, inter,
                 stride_am, stride_we, stride_wn, stride_op,
                 PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[pair, n] = router_weight[pair] * (act[row] . w2[e, n]) for one block of sorted rows."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_ok = pairs < num_pairs
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None].to(tl.int64) * stride_am + k[None, :]
    w_ptrs = w2_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn + k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = k < inter - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    router_w = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)
    acc = acc * router_w[:, None]
    dst = out_ptr + pairs[:, None].to(tl.int64) * stride_op + n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _combine_kernel(pair_out_ptr, out_ptr, hidden, stride_pp, stride_ot,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = sum over slots j of pair_out[t * k + j], in slot order, in float32."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < hidden
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(pair_out_ptr + (t * TOP_K + j) * stride_pp + h, mask=h_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


# ------------------------------------------------------------------------------------------------
# Launch configuration and the entry point
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoEConfig:
    block_m: int
    block_n_up: int      # gate/up GEMM: intermediate columns per program
    block_n_down: int    # down GEMM: hidden columns per program
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def _num_sms(device: torch.device) -> int:
    from deepserve.kernels.paged_attention import _num_sms as sms
    return sms(device)


def pick_config(num_pairs: int, num_experts: int, inter: int, hidden: int, device: torch.device) -> MoEConfig:
    """BLOCK_M follows the rows an active expert gets (small batches waste no padded rows); narrower N tiles
    when few blocks are active, so that a decode step still has enough programs to pull weights at full
    bandwidth (it is bound by reading the active experts' weights, not by arithmetic)."""
    per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    if per_expert > 256:      # prefill: big square tiles (measured best on an H200 at 8k tokens)
        return MoEConfig(128, 128, 128, num_warps=8)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    blocks = cdiv(align_max_rows(num_pairs, num_experts, block_m), block_m)
    target = 2 * _num_sms(device)
    n_up = 32 if blocks * cdiv(inter, 64) < target else 64
    n_down = 32 if blocks * cdiv(hidden, 64) < target else (128 if block_m >= 64 else 64)
    # Few rows per block: long K steps keep more weight bytes in flight per program.
    return MoEConfig(block_m, n_up, n_down, block_k=128 if block_m == 16 else 64)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, swiglu_limit: Optional[float] = None,
              config: Optional[MoEConfig] = None) -> torch.Tensor:
    """x: [T, H]; w13: [E, 2I, H] (gate rows then up rows); w2: [E, H, I]; topk_weights: [T, k] (float32);
    topk_ids: [T, k] -> [T, H] in x's dtype. Same contract as `TorchMoE.forward`."""
    require_triton(x)
    t, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    if t == 0:
        return x.new_empty(0, hidden)
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert w13.stride(-1) == 1 and w2.stride(-1) == 1 and w2.shape == (num_experts, hidden, inter)
    num_pairs = t * top_k
    cfg = config or pick_config(num_pairs, num_experts, inter, hidden, x.device)
    align = moe_align(topk_ids, num_experts, cfg.block_m)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"   # "tf32" only matters for fp32 inputs
    act = torch.empty(align.sorted_pairs.shape[0], inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(align.num_blocks, cdiv(inter, cfg.block_n_up))](
        x, w13, act, align.sorted_pairs, align.block_expert,
        num_pairs, top_k, inter, hidden, float(swiglu_limit or 0.0),
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        HAS_LIMIT=swiglu_limit is not None, PRECISION=precision,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_up, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    # With one expert per token the pair rows are the output rows: no combine.
    pair_out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(align.num_blocks, cdiv(hidden, cfg.block_n_down))](
        act, w2, pair_out, align.sorted_pairs, align.block_expert, weights,
        num_pairs, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0),
        PRECISION=precision, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_down, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if top_k == 1:
        return pair_out
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    block_h = min(1024, next_pow2(hidden))
    _combine_kernel[(t, cdiv(hidden, block_h))](pair_out, out, hidden, pair_out.stride(0), out.stride(0),
                                                TOP_K=top_k, BLOCK_H=block_h, num_warps=4)
    return out


def fused_moe_ref(x, w13, w2, topk_weights, topk_ids, swiglu_limit=None, config=None):
    """The PyTorch twin: the engine's reference expert backend."""
    from deepserve.layers.moe import TorchMoE
    return TorchMoE().forward(x, w13, w2, topk_weights, topk_ids, swiglu_limit)


__all__ = ["MoEAlignment", "MoEConfig", "moe_align", "moe_align_ref", "align_max_rows", "pick_config", "fused_moe",
           "fused_moe_ref"]
