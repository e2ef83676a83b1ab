"""The fused MoE's down GEMM as a persistent kernel: one wave of programs, each walking a contiguous run of
(block of sorted rows, N tile) work items in one flat K loop (kernels/fused_moe.py's aligned mode, `MoEConfig`
field `persistent_down`).

Why: at a decode batch of 256, Qwen3-MoE's down GEMM has K = 768, six 128-wide K steps per program, and read its
experts at 86% of DRAM peak where the gate/up GEMM (K = 2048, sixteen steps) reached 90% (Nsight Compute, H100,
ncu_moe_b256_h100_s37.json). A short program spends a larger share of its life starting (the block's expert, then
its first weight tile's DRAM latency) and draining (the epilogue), and the last wave runs part-full. In one flat
loop the pipeline asks for the next item's first weight tile while the current item's last steps and epilogue
run, and every program gets the same number of items (within one), so the wave ends together.

The number of used blocks (a prefix of the sorted list: the align marks the rest -1) is counted by every program
from block_expert: one [BLOCKS] load, no host sync, no extra output of the align.
"""

from __future__ import annotations

import torch

from deepserve.kernels import cdiv, next_pow2, tl, triton
from deepserve.kernels.gemv import prefetch_rows_to_l2
from deepserve.kernels.moe_align import MoEAlignment, aligned_launch_args
from deepserve.kernels.paged_attention import num_sms
from deepserve.kernels.pdl import pdl_launch_dependents, pdl_wait


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])   # the batch size: no new variant per step
def _down_persistent_kernel(act_ptr, w2_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, weights_ptr,
                            num_pairs, num_blocks, hidden, inter, stride_am, stride_we, stride_wn, stride_op,
                            PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, BLOCKS: tl.constexpr, SPAN: tl.constexpr,
                            EVEN_K: tl.constexpr, USE_PDL: tl.constexpr):
    """out[pair, n] = router_weight[pair] * (act[row] . w2[e, n]) over this program's share of the work items.

    Item i is block i // n_tiles, N tile i % n_tiles (a program's items share blocks, so their activation rows come
    from L2). The activation loads take no row mask: rows are independent in a product, and a padding row's
    (unwritten) values only reach that row of the accumulator, which is never stored. block_expert is read before
    the PDL wait: the align wrote it before the gate/up kernel (the previous one) let this one start (pdl.py, rule 1).
    """
    pid = tl.program_id(0)
    b = tl.arange(0, BLOCKS)
    used = tl.sum((tl.load(block_expert_ptr + b, mask=b < num_blocks, other=-1) >= 0).to(tl.int32), 0)
    n_tiles = tl.cdiv(hidden, BLOCK_N)
    k_steps = tl.cdiv(inter, BLOCK_K)
    items = used * n_tiles
    programs = tl.num_programs(0)
    first = (pid * items) // programs
    last = ((pid + 1) * items) // programs
    # The experts of the (at most SPAN) blocks this program's items fall in, held in registers: a load inside the
    # loop that the weight addresses depend on would cost the pipeline its stages (sm_90 build: one buffer, not two).
    first_block = first // n_tiles
    span = tl.arange(0, SPAN)
    experts = tl.load(block_expert_ptr + first_block + span, mask=first_block + span < num_blocks, other=0)
    if USE_PDL:       # the first item's first K step of weights asked from L2 while the gate/up kernel finishes
        if first < last:
            expert0 = tl.sum(tl.where(span == 0, experts, 0), 0).to(tl.int64)
            n0 = (first - first_block * n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
            prefetch_rows_to_l2(w2_ptr + expert0 * stride_we, n0, n0 < hidden, tl.minimum(inter, BLOCK_K), stride_wn,
                                BLOCK_K)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    cols = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for step in range(first * k_steps, last * k_steps):
        item = step // k_steps
        k0 = (step - item * k_steps) * BLOCK_K
        block = item // n_tiles
        n = (item - block * n_tiles) * BLOCK_N + cols
        n_ok = n < hidden
        expert = tl.sum(tl.where(span == block - first_block, experts, 0), 0).to(tl.int64)
        # The block's pairs, asked for at every K step (an L1 hit but the item's first) and first used in the
        # epilogue: loaded there, the epilogue would stall the loop for their latency once an item.
        pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + m)
        a_ptrs = act_ptr + (block * BLOCK_M + m)[:, None].to(tl.int64) * stride_am + (k0 + k)[None, :]
        w_ptrs = w2_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn + (k0 + k)[:, None]
        if EVEN_K:
            a = tl.load(a_ptrs)
            w = tl.load(w_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = k0 + k < inter
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        if k0 + BLOCK_K >= inter:        # the item's last K step: its epilogue, then a fresh accumulator
            row_ok = pairs < num_pairs
            scale = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)
            dst = out_ptr + pairs[:, None].to(tl.int64) * stride_op + n[None, :]
            tl.store(dst, (acc * scale[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)


def persistent_down(act: torch.Tensor, w2: torch.Tensor, pair_out: torch.Tensor, align: MoEAlignment,
                    weights: torch.Tensor, precision: str, block_n: int, block_k: int, num_warps: int,
                    num_stages: int, programs_per_sm: int) -> None:
    """pair_out[pair] = weights[pair] * (act[row] . w2[expert]^T) for every used block of `align`, in one wave of
    `programs_per_sm` programs per SM (fewer when there are fewer work items than that could ever be)."""
    num_experts, hidden, inter = w2.shape
    n_tiles = cdiv(hidden, block_n)
    most_items = align.num_blocks * n_tiles
    programs = max(1, min(most_items, programs_per_sm * num_sms(act.device)))
    _down_persistent_kernel[(programs,)](
        act, w2, pair_out, align.sorted_pairs, align.block_expert, weights,
        align.num_pairs, align.num_blocks, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0),
        PRECISION=precision, BLOCK_M=align.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCKS=max(16, next_pow2(align.num_blocks)), SPAN=max(2, next_pow2(cdiv(cdiv(most_items, programs), n_tiles) + 1)),
        EVEN_K=inter % block_k == 0,
        num_warps=num_warps, num_stages=num_stages, **aligned_launch_args(act))


__all__ = ["persistent_down"]
