"""Fused mixture-of-experts kernels: the GPU twin of `TorchMoE` (deepserve/layers/moe.py).

Two modes, both with fixed shapes and no host sync (CUDA-graph friendly); `fused_moe` picks one from the number of
(token, expert) pairs (`use_pair_mode`), a forced config picks it for tests and tuning.

Aligned mode (grouped GEMMs, `MoEConfig`): four launches at decode sizes.
  align     (token, slot) pairs grouped by expert, each expert's run padded to a multiple of BLOCK_M rows, so
            every BLOCK_M rows of the sorted list belong to one expert (kernels/moe_align.py: one launch for
            decode batches, three for prefill).
  gate/up   grouped GEMM: block of sorted rows x w13[expert]^T, gate and up tiles in the same program, the
            SwiGLU (with DeepSeek-V4.1's clamp) in the epilogue -> one [rows, I] activation, never [rows, 2I].
  down      grouped GEMM with w2[expert]; the epilogue multiplies by the router weight and writes each pair's
            row.
  shared    (optional, `shared_weights`) the shared experts, a SwiGLU every token goes through, as the first
            blocks of both GEMMs' grids: dense blocks of BLOCK_M tokens, cut into chunks of I columns on the gate/up
            side so every program has the routed ones' N tiles; the down side runs its whole intermediate size in
            the K loop and writes shared_out. No launches of their own (two cuBLAS/skinny GEMMs before), and their
            weight reads start in the first wave beside the routed experts'. (An align computed inside every
            gate/up program instead of its own launch was tried and lost: moe_fused_align_ab_h200.json.)

Pair mode (small decode batches, `MoEPairConfig`): no align, three launches. Grid axis 0 is the pair
p = token * top_k + slot (its expert read from topk_ids in the kernel), axis 1 a tile of output columns; each
program is a GEMV of one activation row against its expert's weight rows (products summed on CUDA cores:
tl.dot needs >= 16 rows, a pair has one).
  gate/up   act[p] = SwiGLU(x[token] . w13[e]^T), gate and up rows interleaved in one weight tile.
  down      pair_out[p] = router_weight[p] * (act[p] . w2[e]^T).
Two tokens that picked the same expert read its weights twice; their programs are neighbours on axis 0, so the
second read mostly hits L2 (see `use_pair_mode` for why that beats the align launch at these sizes).

Both modes end in the combine: out[t] = shared_out[t] (the shared experts' output, optional) + the sum of the
token's top-k pair rows in slot order, in float32 with one rounding (fixed order: a token's result does not depend
on what else is in the batch). Only top_k == 1 without shared_out skips it (the pair rows are the output rows).

Only experts that got tokens do any work, so a batch-1 decode step reads top_k experts' weights and nothing
else. Inputs bf16/fp16/fp32; products accumulate in float32 (fp32 inputs use IEEE products, not TF32).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from deepserve import envs
from deepserve.kernels import cdiv, next_pow2, num_sms, require_triton, tl, triton
from deepserve.kernels.gemv import gemv_rows, prefetch_rows_to_l2, swiglu, swiglu_rows
from deepserve.kernels.moe_align import align_max_rows, aligned_launch_args, moe_align
from deepserve.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait
from deepserve.kernels.reference.moe import PairRows, expert_swiglu, moe_experts


# ------------------------------------------------------------------------------------------------
# Aligned mode: grouped GEMMs over blocks of sorted rows
# ------------------------------------------------------------------------------------------------
# The K mask (k < K - k0) stays on every load, even where K is a multiple of BLOCK_K: without it the loads became
# cp.async copies with fewer registers, yet no decode step moved by more than 0.4% on an H100 (session 32; the A/B
# switch was removed in session 42, docs/gpu.md).
@triton.jit
def _load_rows(a_ptrs, row_ok, k, k0, length):
    """One K step of activation rows, [BLOCK_M, BLOCK_K] at a_ptrs."""
    return tl.load(a_ptrs, mask=row_ok[:, None] & (k < length - k0)[None, :], other=0.0)


@triton.jit
def _load_columns(w_ptrs, n_ok, k, k0, length):
    """One K step of weight columns, [BLOCK_K, BLOCK_N] tiles of w^T at w_ptrs."""
    return tl.load(w_ptrs, mask=(k < length - k0)[:, None] & n_ok[None, :], other=0.0)


@triton.jit
def _swiglu_tile(x_ptrs, g_ptrs, u_ptrs, row_ok, n_ok, hidden, limit, HAS_LIMIT: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_M, BLOCK_N] float32 silu(x . g) * (x . u): x rows at x_ptrs, gate / up weight columns at g_ptrs /
    u_ptrs ([BLOCK_K, BLOCK_N] tiles of w^T), K = hidden."""
    k = tl.arange(0, BLOCK_K)
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        a = _load_rows(x_ptrs, row_ok, k, k0, hidden)
        acc_g = tl.dot(a, _load_columns(g_ptrs, n_ok, k, k0, hidden), acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, _load_columns(u_ptrs, n_ok, k, k0, hidden), acc_u, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    return swiglu(acc_g, acc_u, limit, HAS_LIMIT)


@triton.jit
def _product_tile(a_ptrs, w_ptrs, row_ok, n_ok, length, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_M, BLOCK_N] float32 a . w: rows at a_ptrs, weight columns at w_ptrs ([BLOCK_K, BLOCK_N] tiles of w^T),
    K = length."""
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, length, BLOCK_K):
        a = _load_rows(a_ptrs, row_ok, k, k0, length)
        acc = tl.dot(a, _load_columns(w_ptrs, n_ok, k, k0, length), acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit(do_not_specialize=["num_pairs", "num_tokens"])   # the batch size: no new variant per step
def _gate_up_kernel(x_ptr, w13_ptr, act_ptr, sorted_pairs_ptr, block_expert_ptr, ws_ptr, act_s_ptr,
                    num_pairs, num_tokens, top_k, inter, hidden, shared_inter, limit,
                    stride_xt, stride_we, stride_wn, stride_am, stride_wsn, stride_asm,
                    HAS_LIMIT: tl.constexpr, HAS_SHARED: tl.constexpr, SHARED_CHUNKS: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    USE_PDL: tl.constexpr):
    """act[row, n] = silu(x[token] . w13[e, n]) * (x[token] . w13[e, I + n]) for one block of sorted rows.

    HAS_SHARED: the grid's first programs run the shared experts (ws: [2 * shared_inter, H], gate rows then up
    rows) as a dense block per BLOCK_M tokens, SHARED_CHUNKS programs per block along axis 0, each taking `inter`
    columns of the shared intermediate size (so every program has the same N tiles on axis 1), into act_s[token].
    They come first, so the shared weights are read from the first wave on, beside the routed experts'. (Token
    blocks of up to 64 rows for them, each reading the shared weights once where 16-row blocks read them up to 8
    times, were slower in V2-Lite's steps at batch 64 / 128 by 2.5 / 1.4%: moe_shared_blocks_ab_h200.json.)
    Under PDL it waits first: its rows and experts come from the align just before."""
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    pid_m = tl.program_id(0)
    col = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if HAS_SHARED:
        num_shared = SHARED_CHUNKS * tl.cdiv(num_tokens, BLOCK_M)
    else:
        num_shared = 0
    block = pid_m - num_shared
    if block < 0:       # shared experts: token block pid_m // SHARED_CHUNKS, chunk pid_m % SHARED_CHUNKS
        rows = (pid_m // SHARED_CHUNKS) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < num_tokens
        n = (pid_m % SHARED_CHUNKS) * inter + col
        n_ok = (col < inter) & (n < shared_inter)
        k = tl.arange(0, BLOCK_K)
        g_ptrs = ws_ptr + n[None, :].to(tl.int64) * stride_wsn + k[:, None]
        act = _swiglu_tile(x_ptr + rows[:, None].to(tl.int64) * stride_xt + k[None, :], g_ptrs,
                           g_ptrs + shared_inter * stride_wsn, row_ok, n_ok, hidden, limit, HAS_LIMIT, PRECISION,
                           BLOCK_M, BLOCK_N, BLOCK_K)
        dst = act_s_ptr + rows[:, None].to(tl.int64) * stride_asm + n[None, :]
        tl.store(dst, act.to(act_s_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
        return
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:        # an unused block of the sorted list
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_ok = pairs < num_pairs
    tokens = pairs // top_k
    n_ok = col < inter
    k = tl.arange(0, BLOCK_K)
    # [BLOCK_K, BLOCK_N] tiles of w^T: gate rows n, up rows inter + n.
    g_ptrs = w13_ptr + expert * stride_we + col[None, :].to(tl.int64) * stride_wn + k[:, None]
    act = _swiglu_tile(x_ptr + tokens[:, None].to(tl.int64) * stride_xt + k[None, :], g_ptrs,
                       g_ptrs + inter * stride_wn, row_ok, n_ok, hidden, limit, HAS_LIMIT, PRECISION,
                       BLOCK_M, BLOCK_N, BLOCK_K)
    dst = act_ptr + rows[:, None].to(tl.int64) * stride_am + col[None, :]
    tl.store(dst, act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_tokens"])   # the batch size: no new variant per step
def _down_kernel(act_ptr, w2_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, weights_ptr,
                 act_s_ptr, w2s_ptr, shared_out_ptr,
                 num_pairs, num_tokens, hidden, inter, shared_inter,
                 stride_am, stride_we, stride_wn, stride_op, stride_asm, stride_wsn, stride_so,
                 HAS_SHARED: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """out[pair, n] = router_weight[pair] * (act[row] . w2[e, n]) for one block of sorted rows.

    HAS_SHARED: the grid's first programs are the shared experts' token blocks (BLOCK_M tokens each),
    shared_out[token, n] = act_s[token] . w2s[n] over the whole shared intermediate size (no router weight: the
    combine adds it as is).

    Under PDL the block's expert is read before the wait, and its first K step of weights asked from L2: the align
    wrote block_expert before the gate/up kernel (the previous one) let this one start (kernels/pdl.py, rule 1);
    the activations come after the wait."""
    pid_m = tl.program_id(0)
    if HAS_SHARED:
        num_shared = tl.cdiv(num_tokens, BLOCK_M)
    else:
        num_shared = 0
    block = pid_m - num_shared
    expert = tl.load(block_expert_ptr + tl.maximum(block, 0)).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    if USE_PDL:
        if block < 0:
            prefetch_rows_to_l2(w2s_ptr, n, n_ok, tl.minimum(shared_inter, BLOCK_K), stride_wsn, BLOCK_K)
        elif expert >= 0:
            prefetch_rows_to_l2(w2_ptr + expert * stride_we, n, n_ok, tl.minimum(inter, BLOCK_K), stride_wn, BLOCK_K)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    if block < 0:       # shared experts: token block pid_m
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < num_tokens
        k = tl.arange(0, BLOCK_K)
        acc = _product_tile(act_s_ptr + rows[:, None].to(tl.int64) * stride_asm + k[None, :],
                            w2s_ptr + n[None, :].to(tl.int64) * stride_wsn + k[:, None], row_ok, n_ok, shared_inter,
                            PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        dst = shared_out_ptr + rows[:, None].to(tl.int64) * stride_so + n[None, :]
        tl.store(dst, acc.to(shared_out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])
        return
    if expert < 0:        # an unused block of the sorted list
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows)
    row_ok = pairs < num_pairs
    scale = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)
    k = tl.arange(0, BLOCK_K)
    acc = _product_tile(act_ptr + rows[:, None].to(tl.int64) * stride_am + k[None, :],
                        w2_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn + k[:, None], row_ok, n_ok,
                        inter, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    acc = acc * scale[:, None]
    dst = out_ptr + pairs[:, None].to(tl.int64) * stride_op + n[None, :]
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


# ------------------------------------------------------------------------------------------------
# Pair mode: one (token, expert) pair per program row, no align
# ------------------------------------------------------------------------------------------------
@triton.jit
def _gate_up_pair_kernel(x_ptr, w13_ptr, act_ptr, ids_ptr, top_k, inter, hidden, limit,
                         stride_xt, stride_we, stride_wn, stride_ap,
                         HAS_LIMIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         USE_PDL: tl.constexpr):
    """act[p, n] = silu(x[token] . w13[e, n]) * (x[token] . w13[e, I + n]) for pair p: token p // top_k,
    expert e = ids[p]. No per-step int argument: the number of pairs is the grid. Which weight rows a program
    reads depends on the routing, so nothing loads before the PDL wait."""
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    p = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + p).to(tl.int64)
    token = p // top_k
    act = swiglu_rows(x_ptr + token * stride_xt, w13_ptr + expert * stride_we, tl.program_id(1) * BLOCK_N, inter,
                      hidden, stride_wn, limit, HAS_LIMIT, BLOCK_N, BLOCK_K)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(act_ptr + p * stride_ap + n, act.to(act_ptr.dtype.element_ty), mask=n < inter)


@triton.jit
def _down_pair_kernel(act_ptr, w2_ptr, out_ptr, ids_ptr, weights_ptr, hidden, inter,
                      stride_ap, stride_we, stride_wn, stride_op,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """out[p, n] = router_weight[p] * (act[p] . w2[e, n]) for pair p, expert e = ids[p]."""
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    p = tl.program_id(0).to(tl.int64)
    expert = tl.load(ids_ptr + p).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    acc = gemv_rows(act_ptr + p * stride_ap, w2_ptr + expert * stride_we, n, n_ok, inter, stride_wn, BLOCK_K, False)
    acc = acc * tl.load(weights_ptr + p)
    tl.store(out_ptr + p * stride_op + n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


# ------------------------------------------------------------------------------------------------
# Combine (both modes)
# ------------------------------------------------------------------------------------------------
@triton.jit
def _combine_kernel(pair_out_ptr, shared_ptr, out_ptr, hidden, stride_pp, stride_st, stride_ot,
                    TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):
    """out[t] = sum over slots j of pair_out[t * k + j] in slot order (+ shared[t]), in float32, one rounding."""
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < hidden
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(pair_out_ptr + (t * TOP_K + j) * stride_pp + h, mask=h_ok, other=0.0).to(tl.float32)
    if HAS_SHARED:   # routed sum first, then the shared experts: the reference's order
        acc += tl.load(shared_ptr + t * stride_st + h, mask=h_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


# ------------------------------------------------------------------------------------------------
# Launch configuration and the entry point
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MoEConfig:
    """Aligned mode's tiles: grouped GEMMs over blocks of BLOCK_M sorted rows."""
    block_m: int
    block_n_up: int      # gate/up GEMM: intermediate columns per program
    block_n_down: int    # down GEMM: hidden columns per program
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    # The down GEMM's own K step, warps and stages (None: the gate/up GEMM's). Its K is the intermediate size, often
    # shorter than the hidden size the gate/up GEMM runs over, so fewer K steps per program.
    block_k_down: Optional[int] = None
    num_warps_down: Optional[int] = None
    num_stages_down: Optional[int] = None

    def down_tiles(self) -> tuple[int, int, int]:
        """(BLOCK_K, warps, stages) of the down GEMM."""
        return (self.block_k_down or self.block_k, self.num_warps_down or self.num_warps,
                self.num_stages_down or self.num_stages)


@dataclass(frozen=True)
class MoEPairConfig:
    """Pair mode's tiles: one pair per program row, GEMVs, no align."""
    block_n_up: int      # gate/up: intermediate columns per program (a tile of 2 * block_n_up weight rows)
    block_n_down: int    # down: hidden columns per program
    block_k: int         # elements of a weight row per K step
    num_warps: int = 4


def parse_down_tiles(text: str) -> Optional[tuple[int, int, int, int]]:
    """The down-GEMM tiles of DEEPSERVE_MOE_DOWN_TILES: 'NxKxWARPSxSTAGES' -> (block_n_down, block_k_down, warps,
    stages); '' or 'default' -> None (the pick)."""
    if not text or text == "default":
        return None
    try:
        n, k, warps, stages = (int(p) for p in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"MoE down tiles {text!r} (DEEPSERVE_MOE_DOWN_TILES): expected NxKxWARPSxSTAGES, "
                         "e.g. 256x64x4x3") from None
    if any(v < 16 or v & (v - 1) for v in (n, k)) or warps not in (1, 2, 4, 8) or not 1 <= stages <= 6:
        raise ValueError(f"MoE down tiles {text!r} (DEEPSERVE_MOE_DOWN_TILES): N and K powers of two >= 16, "
                         "warps 1/2/4/8, stages 1-6")
    return n, k, warps, stages


FORCED_DOWN_TILES = parse_down_tiles(envs.DEEPSERVE_MOE_DOWN_TILES)


def pick_config(num_pairs: int, num_experts: int, inter: int, hidden: int, device: torch.device) -> MoEConfig:
    """BLOCK_M follows the rows an active expert gets (small batches waste no padded rows); narrower N tiles
    when few blocks are active, so that a decode step still has enough programs to pull weights at full
    bandwidth (it is bound by reading the active experts' weights, not by arithmetic)."""
    per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    if per_expert > 256:      # prefill: big square tiles (measured best on an H200 at 8k tokens)
        return MoEConfig(128, 128, 128, num_warps=8)
    block_m = 16 if per_expert <= 12 else 32 if per_expert <= 48 else 64
    blocks = cdiv(align_max_rows(num_pairs, num_experts, block_m), block_m)
    target = 2 * num_sms(device)
    n_up = 32 if blocks * cdiv(inter, 64) < target else 64
    n_down = 32 if blocks * cdiv(hidden, 64) < target else (128 if block_m >= 32 else 64)
    # Few rows per block: long K steps keep more weight bytes in flight per program. At 256 decode tokens (16-24
    # rows per expert) 32-row blocks with 128-wide down tiles and K steps were 3% faster than the next best on an
    # H200 (benchmarks/tune_moe_decode.py, tune_moe_decode.json).
    cfg = MoEConfig(block_m, n_up, n_down, block_k=128 if block_m <= 32 else 64)
    if FORCED_DOWN_TILES:
        n, k, warps, stages = FORCED_DOWN_TILES
        cfg = replace(cfg, block_n_down=n, block_k_down=k, num_warps_down=warps, num_stages_down=stages)
    return cfg


PAIR_MODE_MAX_PAIRS = 32


def use_pair_mode(num_pairs: int, num_experts: int) -> bool:
    """Whether a step of `num_pairs` (token, expert) pairs runs in pair mode: no more pairs than experts, and at
    most PAIR_MODE_MAX_PAIRS.

    What the mode saves: the align launch (5.8 us per MoE layer of a DeepSeek-V2-Lite batch-1 step on an H200, a
    serial dependency before the first GEMM) and tl.dot's padding rows (a 16-row block for each one-pair
    expert). What it costs: an expert that two tokens picked is read twice. The two programs are neighbours on
    grid axis 0 and run in the same wave, so the second read mostly hits L2; the price is L2 traffic, which
    grows with the duplicates. A static test on the pair count (no host sync, one mode per captured batch size)
    that keeps duplicates rare: batch 1 has none (a token's experts are distinct), 2 tokens x top-6 of 64 share
    0.56 experts on average (5% more reads), and at most one pair per two experts bounds the rest; the cap keeps
    wide models (Qwen3-MoE, top-8 of 128) to batches <= 4. Measured at the bound's edge on an H200
    (benchmarks/tune_moe_pair.py --tokens 8, tune_moe_pair_b8.json): V2-Lite at batch 8 (48 pairs on 64
    experts, 35 distinct) runs 13% faster aligned (139 us against 160 us per layer), Qwen3-MoE at batch 8 (64 of
    128) the same in both modes alone (129 / 130 us) and DeepSeek-V4.1's experts 8% faster aligned (620 / 675 us,
    tune_moe_pair_v41.json). In Qwen3-MoE decode steps, with session 24's one-launch align, batch 8 is faster
    aligned (2.877 / 2.900 against 3.040 / 3.018 ms; graph replays 2.841 against 2.880), batch 4 (32 pairs) in pair
    mode (1.918 / 1.922 against 1.935 / 1.937 ms): the cap went from 64 pairs to 32 in session 25
    (session25_steps_ab_h200.json). Time both modes by passing a MoEConfig or a MoEPairConfig as fused_moe's
    `config`."""
    return num_pairs <= min(PAIR_MODE_MAX_PAIRS, num_experts // 2)


def pick_pair_config(top_k: int, inter: int, hidden: int, dtype: torch.dtype, device: torch.device) -> MoEPairConfig:
    """Tiles for a decode step, which is bound by reading its experts' weights from HBM: each of a warp's 32 lanes
    loads 16 contiguous bytes of a weight row per K step (BLOCK_K 256 bf16 or 128 fp32 elements), 16 weight rows per
    tile (gate/up: 8 columns' gate and up rows; down: 16 columns), 2 warps. Measured best or within 1% of the best
    of 28 candidates on an H200 at batches 1 and 4 for DeepSeek-V2-Lite (top-6 of 64, I 1408) and Qwen3-MoE (top-8
    of 128, I 768): 34.9 us per MoE layer at batch 1 (3.0 TB/s of expert weights) against 38.5 us aligned
    (benchmarks/tune_moe_pair.py, tune_moe_pair.json). Many small programs (528 gate/up and 768 down programs for
    V2-Lite at batch 1) keep the most loads in flight. One variant for every pair-mode batch size."""
    block_k = 32 * 16 // dtype.itemsize
    block_k = min(block_k, max(16, next_pow2(min(inter, hidden))))    # tiny test shapes: no all-masked lanes
    return MoEPairConfig(block_n_up=8, block_n_down=16, block_k=block_k, num_warps=2)


def pick_moe_config(num_tokens: int, top_k: int, num_experts: int, inter: int, hidden: int, dtype: torch.dtype,
                    device: torch.device) -> MoEConfig | MoEPairConfig:
    """The mode (by `use_pair_mode`) and its tiles (by the pick_* heuristics) for a step of `num_tokens` tokens."""
    num_pairs = num_tokens * top_k
    if use_pair_mode(num_pairs, num_experts):
        return pick_pair_config(top_k, inter, hidden, dtype, device)
    return pick_config(num_pairs, num_experts, inter, hidden, device)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, swiglu_limit: Optional[float] = None,
              config: Optional[MoEConfig | MoEPairConfig] = None,
              shared_out: Optional[torch.Tensor] = None,
              shared_weights: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
              combine: bool = True) -> torch.Tensor | PairRows:
    """x: [T, H]; w13: [E, 2I, H] (gate rows then up rows); w2: [E, H, I]; topk_weights: [T, k] (float32);
    topk_ids: [T, k]; shared_out: None or [T, H] (the shared experts' output, added in the combine) -> [T, H] in
    x's dtype. Same contract as `TorchMoE.forward`.

    shared_weights: None or (gate_up [2S, H], down [H, S]) in x's dtype, the shared experts' weights (a SwiGLU every
    token goes through, with the routed experts' swiglu_limit), instead of shared_out: the aligned mode runs them as
    extra blocks of its two grouped GEMMs (no launches of their own); the pair mode computes them with torch first.
    Either way their output is rounded to x's dtype and added in the combine, as shared_out would be.

    `config` forces a mode and its tiles (tests, tuning): a MoEConfig the aligned grouped GEMMs, a MoEPairConfig
    the pair mode; None picks both by `pick_moe_config`.

    `combine` False: no combine launch; the weighted pair rows and the shared output come back as a PairRows, for
    the add + RMSNorm that reads the layer's output to sum (kernels/norm.py combine_add_rms_norm)."""
    require_triton(x)
    t, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    if t == 0:
        empty = x.new_empty(0, hidden)
        return empty if combine else PairRows(empty, top_k)
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert w13.stride(-1) == 1 and w2.stride(-1) == 1 and w2.shape == (num_experts, hidden, inter)
    if config is None:
        config = pick_moe_config(t, top_k, num_experts, inter, hidden, x.dtype, x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    if shared_weights is not None:
        assert shared_out is None, "give the shared experts' output or their weights, not both"
        _check_shared_weights(x, *shared_weights)
    if isinstance(config, MoEPairConfig):
        if shared_weights is not None:
            shared_out = expert_swiglu(x, *shared_weights, swiglu_limit)
        pair_out = _pair_experts(x, w13, w2, weights, topk_ids, swiglu_limit, config)
    else:
        pair_out, fused_shared_out = _aligned_experts(x, w13, w2, weights, topk_ids, swiglu_limit, config,
                                                      shared_weights)
        shared_out = shared_out if fused_shared_out is None else fused_shared_out
    if not combine:
        return PairRows(pair_out, top_k, shared_out)
    return moe_combine(pair_out, top_k, shared_out)


def _check_shared_weights(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    hidden = x.shape[1]
    shared_inter = down.shape[1]
    assert gate_up.shape == (2 * shared_inter, hidden) and down.shape == (hidden, shared_inter), \
        f"shared experts' weights {tuple(gate_up.shape)}, {tuple(down.shape)} for hidden size {hidden}"
    assert gate_up.dtype == down.dtype == x.dtype, "the shared experts' weights must be in x's dtype"
    assert gate_up.stride(-1) == 1 and down.stride(-1) == 1


def _aligned_experts(x, w13, w2, weights, topk_ids, swiglu_limit, cfg: MoEConfig, shared_weights=None):
    """([pairs, H] weighted expert outputs, [T, H] shared experts' output or None): align, then grouped GEMMs over
    blocks of sorted rows, after the shared experts' token blocks when `shared_weights` is given."""
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    num_tokens, top_k = topk_ids.shape
    num_pairs = topk_ids.numel()
    align = moe_align(topk_ids, num_experts, cfg.block_m)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"   # "tf32" only matters for fp32 inputs
    act = torch.empty(align.sorted_pairs.shape[0], inter, dtype=x.dtype, device=x.device)
    pair_out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    if shared_weights is not None:
        ws13, ws2 = shared_weights
        shared_inter = ws2.shape[1]
        chunks = cdiv(shared_inter, inter)       # programs per token block along axis 0, `inter` columns each
        token_blocks = cdiv(num_tokens, cfg.block_m)
        act_s = torch.empty(num_tokens, shared_inter, dtype=x.dtype, device=x.device)
        shared_out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    else:                                         # placeholders: no shared blocks in the grid
        ws13, ws2, act_s, shared_out = w13, w2, act, None
        shared_inter, chunks, token_blocks = 0, 1, 0
    _gate_up_kernel[(chunks * token_blocks + align.num_blocks, cdiv(inter, cfg.block_n_up))](
        x, w13, act, align.sorted_pairs, align.block_expert, ws13, act_s,
        num_pairs, num_tokens, top_k, inter, hidden, shared_inter, float(swiglu_limit or 0.0),
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0), ws13.stride(-2), act_s.stride(0),
        HAS_LIMIT=swiglu_limit is not None, HAS_SHARED=shared_out is not None, SHARED_CHUNKS=chunks,
        PRECISION=precision, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_up, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **aligned_launch_args(x))
    shared_dst = shared_out if shared_out is not None else pair_out
    down_k, down_warps, down_stages = cfg.down_tiles()
    _down_kernel[(token_blocks + align.num_blocks, cdiv(hidden, cfg.block_n_down))](
        act, w2, pair_out, align.sorted_pairs, align.block_expert, weights, act_s, ws2, shared_dst,
        num_pairs, num_tokens, hidden, inter, shared_inter,
        act.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0), act_s.stride(0), ws2.stride(-2),
        shared_dst.stride(0),
        HAS_SHARED=shared_out is not None, PRECISION=precision,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_down, BLOCK_K=down_k,
        num_warps=down_warps, num_stages=down_stages, **aligned_launch_args(x))
    return pair_out, shared_out


def _pair_experts(x, w13, w2, weights, topk_ids, swiglu_limit, cfg: MoEPairConfig) -> torch.Tensor:
    """[pairs, H] weighted expert outputs: two GEMV launches over a (pair, N tile) grid. Pairs are axis 0, the
    fastest-varying, so the pairs that picked one expert read its weight tiles in the same wave."""
    num_pairs, top_k = topk_ids.numel(), topk_ids.shape[1]
    hidden, inter = w2.shape[1], w2.shape[2]
    ids = topk_ids.reshape(-1)
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    _gate_up_pair_kernel[(num_pairs, cdiv(inter, cfg.block_n_up))](
        x, w13, act, ids, top_k, inter, hidden, float(swiglu_limit or 0.0),
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        HAS_LIMIT=swiglu_limit is not None, BLOCK_N=cfg.block_n_up, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        **pdl_launch_args(x))
    pair_out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _down_pair_kernel[(num_pairs, cdiv(hidden, cfg.block_n_down))](
        act, w2, pair_out, ids, weights, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), pair_out.stride(0),
        BLOCK_N=cfg.block_n_down, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, **pdl_launch_args(x))
    return pair_out


def moe_combine(pair_out: torch.Tensor, top_k: int, shared_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """pair_out [T * top_k, H] -> [T, H]: each token's top_k pair rows summed in slot order, plus shared_out
    ([T, H]), in float32, one rounding."""
    if top_k == 1 and shared_out is None:
        return pair_out      # one expert per token and nothing to add: the pair rows are the output rows
    t, hidden = pair_out.shape[0] // top_k, pair_out.shape[1]
    if shared_out is not None:
        assert shared_out.shape == (t, hidden), f"shared_out {tuple(shared_out.shape)} != {(t, hidden)}"
        if shared_out.stride(-1) != 1:
            shared_out = shared_out.contiguous()
    shared = shared_out if shared_out is not None else pair_out      # a placeholder without HAS_SHARED
    out = torch.empty(t, hidden, dtype=pair_out.dtype, device=pair_out.device)
    block_h = min(1024, next_pow2(hidden))
    _combine_kernel[(t, cdiv(hidden, block_h))](
        pair_out, shared, out, hidden, pair_out.stride(0), shared.stride(0), out.stride(0),
        TOP_K=top_k, HAS_SHARED=shared_out is not None, BLOCK_H=block_h, num_warps=4, **pdl_launch_args(out))
    return out


def fused_moe_ref(x, w13, w2, topk_weights, topk_ids, swiglu_limit=None, config=None, shared_out=None,
                  shared_weights=None):
    """The PyTorch twin: the engine's reference expert backend (with `shared_weights`, the shared experts' SwiGLU
    in torch first, as layers/mlp.GatedMLP computes it)."""
    if shared_weights is not None:
        shared_out = expert_swiglu(x, *shared_weights, swiglu_limit)
    return moe_experts(x, w13, w2, topk_weights, topk_ids, swiglu_limit, shared_out)


__all__ = ["MoEConfig", "MoEPairConfig", "PAIR_MODE_MAX_PAIRS", "pick_config", "pick_moe_config", "pick_pair_config",
           "use_pair_mode", "moe_combine", "fused_moe", "fused_moe_ref"]
