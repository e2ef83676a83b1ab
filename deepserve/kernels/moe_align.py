"""MoE align: the (token, slot) pairs of a step grouped by expert, each expert's run padded to a multiple of BLOCK_M
rows, so that every BLOCK_M rows of the sorted list belong to one expert: what the aligned mode's grouped GEMMs
(kernels/fused_moe.py) read. Fixed shapes, no host sync (CUDA-graph friendly). Two launch shapes by batch size:
  one program with atomics   decode batches up to SINGLE_ALIGN_MAX_PAIRS pairs (`_align_single_kernel`);
  three launches             prefill: a counter memset, an atomic count over many programs, the place kernel.
A third, one program counting in registers (one-hot [pairs, experts] tiles), served small decode batches until
session 25 and stays behind ONE_HOT_MAX_PAIRS (0) for A/Bs.
`moe_align_ref` is the torch twin (a stable sort) the tests hold them to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepserve import envs
from deepserve.kernels import cdiv, next_pow2, tl, triton
from deepserve.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait

_ALIGN_CELLS = 8192      # one-hot cells [pairs, experts] per align program: bounds its registers


@dataclass
class MoEAlignment:
    sorted_pairs: torch.Tensor   # [max_rows] int32: pair (token * top_k + slot) of each row; num_pairs = padding
    block_expert: torch.Tensor   # [max_rows / block_m] int32: expert of each block of rows; -1 = unused block
    block_m: int
    num_pairs: int

    @property
    def num_blocks(self) -> int:
        return int(self.block_expert.shape[0])


def aligned_launch_args(tensor: torch.Tensor) -> dict:
    """The PDL keywords of the aligned path's launches (align, grouped gate/up, grouped down): without PDL each of
    them started only after its predecessor had finished, a launch latency each (benchmarks/ab_kernel_modes.py
    `moe_aligned_nopdl` patches this to time that)."""
    return pdl_launch_args(tensor)


def align_max_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """A static bound on the padded rows (no host sync): each expert that got a pair pads < block_m rows, and at
    most min(pairs, experts) experts got one."""
    rows = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return cdiv(rows, block_m) * block_m


@triton.jit(do_not_specialize=["num_pairs"])   # the batch size: no new variant per step
def _align_count_kernel(ids_ptr, counts_ptr, rank_ptr, num_pairs, CHUNK: tl.constexpr, USE_PDL: tl.constexpr):
    """counts[e] = pairs routed to e; rank[p] = pair p's place among them (an atomic's old value: the order
    inside an expert's run is arbitrary, which no result depends on, as GEMM rows are independent)."""
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    p = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    ok = p < num_pairs
    ids = tl.load(ids_ptr + p, mask=ok, other=0).to(tl.int32)
    rank = tl.atomic_add(counts_ptr + ids, tl.full([CHUNK], 1, tl.int32), mask=ok, sem="relaxed")
    tl.store(rank_ptr + p, rank, mask=ok)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])   # the batch size: no new variant per step
def _align_place_kernel(ids_ptr, counts_ptr, rank_ptr, sorted_pairs_ptr, block_expert_ptr,
                        num_pairs, num_experts, num_blocks,
                        BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                        COUNT_HERE: tl.constexpr, USE_PDL: tl.constexpr):
    """Every program rebuilds the (tiny) run layout from the counts, then places its chunk of pairs and labels
    its chunk of blocks with their expert; program 0 also fills the padding rows. COUNT_HERE (one program
    holding every pair: small decode batches) counts and ranks in registers instead, so the whole align is
    one launch."""
    pdl_wait(USE_PDL)              # the ids come from the routing kernel just before
    pdl_launch_dependents(USE_PDL)
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


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])   # the batch size: no new variant per step
def _align_single_kernel(ids_ptr, scratch_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs, num_experts, num_blocks,
                         BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, LOG_E: tl.constexpr, PAIRS: tl.constexpr,
                         BLOCKS: tl.constexpr, GATHER: tl.constexpr, USE_PDL: tl.constexpr):
    """The whole align in one program, for a decode batch's pairs (up to SINGLE_ALIGN_MAX_PAIRS): what the memset,
    the count kernel and the place kernel do in three launches, with the block's barriers between the phases.
    scratch: [2 * BLOCK_E] int32, the counts then (without GATHER) the run starts (zeroed here first: no memset
    launch).

    Counting is one atomic per pair on the scratch counters (its old value is the pair's rank among its expert's
    pairs, as in _align_count_kernel). GATHER (ALIGN_GATHER, the default): a pair's run start is a tl.gather from
    the run starts in registers, and each expert's blocks are labelled by stores. Else both are gathers from the
    scratch (a binary search over the run ends for a block's expert). Neither builds [pairs, experts] one-hot
    tiles, so registers stay [PAIRS] + [BLOCKS] + [BLOCK_E, BLOCK_M]. The barriers order the scratch's writes before
    its reads within the program (what __syncthreads guarantees for global memory); the reads skip L1 all the same
    (.cg)."""
    pdl_wait(USE_PDL)              # the ids come from the routing kernel just before
    pdl_launch_dependents(USE_PDL)
    e = tl.arange(0, BLOCK_E)
    e_ok = e < num_experts
    tl.store(scratch_ptr + e, tl.zeros([BLOCK_E], tl.int32))
    tl.debug_barrier()
    p = tl.arange(0, PAIRS)
    p_ok = p < num_pairs
    ids = tl.load(ids_ptr + p, mask=p_ok, other=0).to(tl.int32)
    rank = tl.atomic_add(scratch_ptr + ids, tl.full([PAIRS], 1, tl.int32), mask=p_ok, sem="relaxed")
    tl.debug_barrier()
    counts = tl.load(scratch_ptr + e, mask=e_ok, other=0, cache_modifier=".cg")
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    run_end = tl.cumsum(padded, 0)
    run_start = run_end - padded
    if GATHER:        # a pair's run start gathered in the program's registers and shared memory: no round trip
        start = tl.gather(run_start, ids, 0)
    else:
        tl.store(scratch_ptr + BLOCK_E + e, run_start)
        tl.debug_barrier()
        start = tl.load(scratch_ptr + BLOCK_E + ids, mask=p_ok, other=0, cache_modifier=".cg")
    tl.store(sorted_pairs_ptr + start + rank, p, mask=p_ok)
    b = tl.arange(0, BLOCKS)
    total = tl.sum(padded, 0)
    if GATHER:
        # Blocks: each expert's run of blocks labelled with it, one [experts] store per block of the longest run
        # (stores only: nothing waits on a load); the blocks past the runs get -1.
        tl.store(block_expert_ptr + b, tl.full([BLOCKS], -1, tl.int32), mask=(b * BLOCK_M >= total) & (b < num_blocks))
        run_blocks = padded // BLOCK_M
        for j in range(0, tl.max(run_blocks, 0)):
            tl.store(block_expert_ptr + run_start // BLOCK_M + j, e, mask=j < run_blocks)
    else:
        # Blocks: the expert is the number of runs that end at or before the block's first row, found by binary
        # lifting over the run ends (run_end[j] = run_start[j + 1]; the last one, the total, is past every used
        # block's first row only for blocks past the runs, which get -1).
        first_row = b * BLOCK_M
        owner = tl.zeros([BLOCKS], tl.int32)
        for i in tl.static_range(LOG_E + 1):
            cand = owner + (BLOCK_E >> i)
            # run_end[cand - 1] = run_start[cand] for cand < num_experts; the total for cand == num_experts.
            end = tl.load(scratch_ptr + BLOCK_E + cand, mask=cand < num_experts, other=0, cache_modifier=".cg")
            end = tl.where(cand == num_experts, total, end)
            owner = tl.where((cand <= num_experts) & (end <= first_row), cand, owner)
        tl.store(block_expert_ptr + b, tl.where(owner < num_experts, owner, -1), mask=b < num_blocks)
    # Padding: the rows after each expert's pairs up to the end of its run, one [experts, BLOCK_M] store.
    j = tl.arange(0, BLOCK_M)
    pad_rows = (run_start + counts)[:, None] + j[None, :]
    pad_ok = e_ok[:, None] & ((counts[:, None] + j[None, :]) < padded[:, None])
    tl.store(sorted_pairs_ptr + pad_rows, tl.full([BLOCK_E, BLOCK_M], 0, tl.int32) + num_pairs, mask=pad_ok)


# Up to this many (token, expert) pairs a multi-program align (memset, count, place: three launches) is replaced by
# _align_single_kernel (one): a decode batch of 256 tokens at top-8. Measured on an H200 (moe_align_ab.py,
# moe_align_single_ab_h200.json, us per align in a CUDA graph, one program against three launches): V2-Lite's
# 32 / 128 / 256 tokens (192 / 768 / 1536 pairs) 2.6 / 3.5 / 5.6 against 5.7 / 5.9 / 6.6, Qwen3-MoE's 128 / 256
# (1024 / 2048 pairs) 4.4 / 7.1 against 6.7 / 8.0; at 512 tokens (3072 / 4096 pairs) the one program lost, 7.5 /
# 10.1 against 7.2 / 8.2.
SINGLE_ALIGN_MAX_PAIRS = 2048
# The one-hot program (the place kernel counting in registers) for at most this many pairs (where its tiles hold
# them): 0 since session 25, when the program with atomics won there too (moe_align_one_hot_ab_h200.json, us per
# align in a CUDA graph): V2-Lite at 6 / 8 / 12 / 16 tokens 2.7 / 2.7 / 2.6 / 2.6 against 3.0 / 3.0 / 5.8 / 5.8,
# Qwen3-MoE at 6 / 8 5.5 against 3.0 / 2.9; Qwen3-MoE batch-8 steps 2.879 / 2.890 -> 2.846 / 2.846 ms, V2-Lite
# batch 16 graph replays 7.140 -> 7.052 ms (session25_steps_ab_h200.json).
ONE_HOT_MAX_PAIRS = 0
# DEEPSERVE_MOE_ALIGN_GATHER (on; 0 for A/Bs): the one-program align looks a pair's run start up with tl.gather and
# labels the blocks with stores (each expert's run of blocks), instead of a store + barrier + load round trip through
# its scratch and a binary search of 8 dependent loads over it. The align is on a MoE layer's critical path (the
# gate/up GEMM waits for it). H100, us per align in a CUDA graph (moe_align_gather_ab_h100_s37.json), before -> after:
# Qwen3-MoE 8 / 64 / 256 tokens 2.77 / 3.52 / 7.26 -> 1.81 / 2.23 / 4.79, V2-Lite 2.77 / 2.90 / 5.79 -> 1.94 / 1.89 /
# 3.71. Decode steps over E4M3, two passes (moe_align_gather_steps_ab_h100_s37.json), ms: Qwen3-MoE batch 256 9.757 /
# 9.743 -> 9.710 / 9.704, batch 64 8.108 / 8.109 -> 8.091 / 8.098; V2-Lite batch 256 15.612 / 15.614 -> 15.588 /
# 15.572, batch 64 12.535 / 12.540 -> 12.515 / 12.511.
ALIGN_GATHER = envs.DEEPSERVE_MOE_ALIGN_GATHER


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Pairs of `topk_ids` [T, k] grouped by expert, each expert's run padded to a multiple of block_m. Fixed
    shapes, no host sync (CUDA-graph friendly): one launch up to SINGLE_ALIGN_MAX_PAIRS pairs (decode; with atomics
    on a scratch, or counting in registers up to ONE_HOT_MAX_PAIRS where one program's one-hot tiles hold every pair
    and block), else three (a counter memset, an atomic count, the place kernel)."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    max_rows = align_max_rows(num_pairs, num_experts, block_m)
    num_blocks = max_rows // block_m
    sorted_pairs = torch.empty(max_rows, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    block_e = max(16, next_pow2(num_experts))
    chunk = max(16, min(128, _ALIGN_CELLS // block_e))
    one_program = num_pairs <= min(chunk, ONE_HOT_MAX_PAIRS) and num_blocks <= chunk
    if one_program:
        # The one program's one-hot tiles sized to what it holds (V2-Lite at 8 tokens: 48 pairs and blocks, 64
        # rows instead of 128): a latency-bound launch, whose scans over the tile's rows are most of its time.
        chunk = max(16, next_pow2(max(num_pairs, num_blocks)))
    if not one_program and num_pairs <= SINGLE_ALIGN_MAX_PAIRS:
        # Tiles of at least 16 lanes (masked past the pairs, experts and blocks), as the other align kernels'.
        scratch = torch.empty(2 * block_e, dtype=torch.int32, device=device)
        pairs = max(16, next_pow2(num_pairs))
        _align_single_kernel[(1,)](flat, scratch, sorted_pairs, block_expert, num_pairs, num_experts, num_blocks,
                                   BLOCK_M=block_m, BLOCK_E=block_e, LOG_E=block_e.bit_length() - 1, PAIRS=pairs,
                                   BLOCKS=max(16, next_pow2(num_blocks)), GATHER=ALIGN_GATHER, num_warps=8,
                                   **aligned_launch_args(flat))
        return MoEAlignment(sorted_pairs, block_expert, block_m, num_pairs)
    if one_program:
        counts = rank = sorted_pairs     # unused
    else:
        counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
        rank = torch.empty(num_pairs, dtype=torch.int32, device=device)
        _align_count_kernel[(cdiv(num_pairs, chunk),)](flat, counts, rank, num_pairs, CHUNK=chunk, num_warps=4,
                                                       **aligned_launch_args(flat))
    grid = max(cdiv(num_pairs, chunk), cdiv(num_blocks, chunk))
    _align_place_kernel[(grid,)](flat, counts, rank, sorted_pairs, block_expert, num_pairs, num_experts,
                                 num_blocks, BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk,
                                 COUNT_HERE=one_program, num_warps=4, **aligned_launch_args(flat))
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


__all__ = ["MoEAlignment", "SINGLE_ALIGN_MAX_PAIRS", "align_max_rows", "aligned_launch_args", "moe_align",
           "moe_align_ref"]
