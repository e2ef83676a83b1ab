"""GEMM for a few activation rows on the GPU: y = x W^T (+ bias) for 2 <= M <= skinny_max_rows(N, K) rows (33-64
for the weights `skinny_wide_tiles` names), optionally with the SwiGLU in the epilogue. The GPU twin of `F.linear`
in decode steps of a small batch (deepserve/layers/linear.py dispatches to it; one row goes to the GEMV of
kernels/gemv.py instead).

Why: a decode step of 8 sequences reads each weight once and multiplies it by 8 rows, so it is a weight stream, as
at batch 1. cuBLAS runs such shapes at 1.4-2.0 TB/s for the 4-12 MB matrices of a small model's layer (latency, not
bandwidth, bounds them). Here the roles are swapped: the weight tile [BLOCK_N, BLOCK_K] is the MMA's left operand
(BLOCK_N of at least 16 fills its rows) and the rows of x, padded to BLOCK_M (16 and up), the right one; each program
streams BLOCK_N weight rows through a pipelined K loop into a [BLOCK_N, BLOCK_M] float32 accumulator. Nothing is
wasted on the padding but MMA slots, which are free here. It is launched with PDL (kernels/pdl.py): the programs
ask L2 for their first weights while the previous kernel drains, and the layer's launches chain without cuBLAS's
gaps. Measured on an H200 (benchmarks/tune_skinny_gemm_grid.json, skinny_ab_h200.json): 2048x2048 at M = 8 in
5.2 us against cuBLAS's 6.0; Llama-3.2-1B decode steps at batch 2-16 4-9% faster, DeepSeek-V2-Lite's at batch 8-16 2-3%;
but Qwen3-30B-A3B's 1.5-3% slower, not yet understood (DEEPSERVE_SKINNY_GEMM=0 keeps cuBLAS).

Split-K (narrow weights of long rows, `skinny_tiles`): a 2048-row weight gives 128 programs of 16-row tiles, each
with 8 KB a K step in flight, or 32 programs of 64-row tiles; split in 4 parts along K it gives 128 programs of
64-row tiles, four times the bytes in flight per SM. The tile's last part to finish sums the float32 partials in
part order (`_split_k_sum`: one launch, no reduce kernel, the same result whichever part ends last).

SwiGLU mode (a gate/up weight [2I, K], gate rows then up rows) interleaves each program's gate and up rows in one
tile, as the GEMV does, so the activation is formed in registers: the gate/up output never goes through memory
and the SiLU-and-mul launch disappears. Gate and up are rounded to the activation dtype first, as the GEMM's output
would be, so the result matches the unfused path up to the GEMM's summation order.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from deepserve import envs
from deepserve.kernels import USE_LIBDEVICE, next_pow2, require_triton, tl, triton
from deepserve.kernels.activation import silu_mul
from deepserve.kernels.gemv import prefetch_rows_to_l2
from deepserve.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait

SKINNY_MAX_ROWS = 16            # more rows stay on cuBLAS (whose larger tiles then do fill the tensor cores) ...
SKINNY_MAX_ROWS_SHORT_K = 32    # ... except for rows of at most SHORT_K elements and weights of at least WIDE_N
SHORT_K = 2048                  # rows: up to 32 rows here
WIDE_N = 4096
SPLIT_K_MIN_K = 4096            # narrower weights of rows at least this long split K (skinny_tiles)
# DEEPSERVE_SKINNY_64_ROWS (on; 0 for A/Bs): 33-64 rows here too, for the weights `skinny_wide_tiles` names.
WIDE_ROWS = envs.DEEPSERVE_SKINNY_64_ROWS
WIDE_MAX_ROWS = 64


class SkinnyTiles(NamedTuple):
    """A launch setting: weight rows per program, K step, warps, pipeline stages, what a program does with its
    weights before the PDL wait (0 nothing, 1 asks L2 for its first K step, 2 for all of its rows; the default, 1,
    is the batch-1 GEMV's; an H200 sweep of the three modes on the engine's tilings saw differences within the
    run-to-run noise), and in how many parts K is split (`split_k`; see `_split_k_sum`)."""
    block_n: int
    block_k: int
    warps: int
    stages: int
    prefetch: int = 1
    split_k: int = 1


# Split-K launches count each output tile's finished parts on these int32 counters (one per tile, zero between
# launches: the tile's last part sets it back). One buffer per device, made by the first split launch outside a
# CUDA-graph capture (the engine's warm-up runs before it captures); a launch with more tiles does not split.
SPLIT_COUNTERS = 8192
_split_counters: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _split_k_sum(acc, part_ptr, counter_ptr, tile, split, num_tiles, r, m, m_ok, SPLIT_K: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """(sum of the tile's SPLIT_K partial accumulators, whether this program is the tile's last part to finish).

    Each part stores its float32 partial, then takes a ticket on the tile's counter; the part that draws the last
    ticket sums all the partials (in split order, so the result does not depend on which part finished last) and
    resets the counter for the next launch: one launch, no reduce kernel. Which parts finish first varies; the sum
    does not."""
    tile_offs = r[:, None] * BLOCK_M + m[None, :]
    tl.store(part_ptr + (split * num_tiles + tile) * (BLOCK_N * BLOCK_M) + tile_offs, acc, mask=m_ok[None, :])
    tl.debug_barrier()          # every thread's partial stored before the ticket (whose release publishes them)
    ticket = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
    last = ticket == SPLIT_K - 1
    if last:
        acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        for s in tl.static_range(SPLIT_K):      # .cg: from L2, never a stale L1 line of an earlier launch
            acc += tl.load(part_ptr + (s * num_tiles + tile) * (BLOCK_N * BLOCK_M) + tile_offs,
                           mask=m_ok[None, :], other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed")
    return acc, last


@triton.jit
def _skinny_product(x_ptr, w_ptr, rows, rows_ok, m, m_ok, k_start, k_end, stride_xm, stride_wn,
                    EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                    PREFETCH: tl.constexpr, USE_PDL: tl.constexpr):
    """[BLOCK_N, BLOCK_M] float32: w[rows, k_start:k_end] . x[m, k_start:k_end] for the program's weight rows and the
    activation rows m (x^T the MMA's right operand). Waits for the previous kernel (PDL) after asking L2 for its
    first weights."""
    k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + k_start + k[None, :]
    x_ptrs = x_ptr + m[None, :].to(tl.int64) * stride_xm + k_start + k[:, None]          # x^T: [BLOCK_K, BLOCK_M]
    # x comes from the previous kernel (rule 1 of kernels/pdl.py). The weights are constant: while that kernel
    # drains, the program asks L2 for them (loading them into registers would take the first stage out of the K
    # loop's software pipeline), so the loop's first loads hit L2.
    if USE_PDL and PREFETCH == 1:
        prefetch_rows_to_l2(w_ptr + k_start, rows, rows_ok, tl.minimum(k_end - k_start, BLOCK_K), stride_wn, BLOCK_K)
    if USE_PDL and PREFETCH == 2:
        prefetch_rows_to_l2(w_ptr + k_start, rows, rows_ok, k_end - k_start, stride_wn, BLOCK_K)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            k_ok = k < BLOCK_K
            w = tl.load(w_ptrs, mask=rows_ok[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = k < k_end - k0
            w = tl.load(w_ptrs, mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(w, x, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    return acc


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, m_rows, n_out, k_len, stride_xm, stride_wn, stride_ym, limit,
                   w2_ptr, y2_ptr, n_out2, stride_w2n, stride_y2m, programs_first,
                   part_ptr, counter_ptr, k_per_split,
                   HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr, TWO: tl.constexpr,
                   ACCURATE_EXP: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr, SPLIT_K: tl.constexpr, USE_PDL: tl.constexpr):
    """y[:m_rows, n] for this program's BLOCK_N weight rows (SWIGLU: BLOCK_N // 2 output columns, n_out = I).
    TWO: the programs from `programs_first` on compute y2 = x w2^T (n_out2 rows) instead: two weights that share
    their input (MLA's q and kv_a projections) in one launch. SPLIT_K > 1: program (tile, s) of grid axis 1 sums
    K range [s * k_per_split, (s + 1) * k_per_split) and the tile's last part writes y (`_split_k_sum`)."""
    tile = tl.program_id(0)
    pid = tile
    if TWO:
        if pid >= programs_first:
            pid -= programs_first
            w_ptr = w2_ptr
            y_ptr = y2_ptr
            n_out = n_out2
            stride_wn = stride_w2n
            stride_ym = stride_y2m
    dtype = y_ptr.dtype.element_ty
    r = tl.arange(0, BLOCK_N)
    if SWIGLU:                  # rows 2c and 2c + 1 of the tile: gate and up of column c
        col = pid * (BLOCK_N // 2) + r // 2
        rows = col + (r % 2) * n_out
        rows_ok = col < n_out
    else:
        rows = pid * BLOCK_N + r
        rows_ok = rows < n_out
    m = tl.arange(0, BLOCK_M)
    m_ok = m < m_rows
    k_start = 0
    k_end = k_len
    if SPLIT_K > 1:
        k_start = tl.program_id(1) * k_per_split
        k_end = tl.minimum(k_start + k_per_split, k_len)
    acc = _skinny_product(x_ptr, w_ptr, rows, rows_ok, m, m_ok, k_start, k_end, stride_xm, stride_wn,
                          EVEN_K, BLOCK_N, BLOCK_M, BLOCK_K, PREFETCH, USE_PDL)
    if SPLIT_K > 1:
        acc, last = _split_k_sum(acc, part_ptr, counter_ptr, tile, tl.program_id(1), tl.num_programs(0), r, m, m_ok,
                                 SPLIT_K, BLOCK_N, BLOCK_M)
        if not last:
            return
    if SWIGLU:
        # [BLOCK_N, M] -> [BLOCK_N // 2, M, 2] -> gate, up: each rounded as the GEMM's output would be.
        gate, up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_N // 2, 2, BLOCK_M]), [0, 2, 1]))
        gate = gate.to(dtype).to(tl.float32)
        up = up.to(dtype).to(tl.float32)
        if HAS_LIMIT:           # DeepSeek-V4.1's clamp (layers/mlp.py swiglu_activation)
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        c = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        out = silu_mul(gate, up, dtype, ACCURATE_EXP)
        tl.store(y_ptr + m[None, :].to(tl.int64) * stride_ym + c[:, None], out,
                 mask=(c < n_out)[:, None] & m_ok[None, :])
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows, mask=rows_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + m[None, :].to(tl.int64) * stride_ym + rows[:, None], acc.to(dtype),
                 mask=rows_ok[:, None] & m_ok[None, :])


def skinny_tiles(n: int, k: int) -> SkinnyTiles:
    """The launch setting for a [N, K] weight, from H200 sweeps at M = 8 and 32 (benchmarks/tune_skinny_gemm_grid.json,
    tune_skinny_split_h200.json; microseconds against cuBLAS's, SwiGLU shapes against cuBLAS + SiLU-and-mul):
      - narrow weights of long rows (fewer than WIDE_N rows of at least SPLIT_K_MIN_K: Llama-3.2-1B's down 2048x8192,
        Qwen3-MoE's o_proj 2048x4096): 64 rows per tile, K steps of 256, K split in 4 parts (`_split_k_sum`): 32
        tiles x 4 parts, each program streaming a 64-row slab of a quarter of K (1B down 11.5 us at M = 8 / 32
        against cuBLAS's 13.6 / 14.0 and 14.3 / 13.0 unsplit; Qwen3-MoE o_proj 7.1 / 7.1 against 9.4 / 9.6 and 8.2 /
        7.5 unsplit). No
        other weight of the sweep gained from a split: with 128+ tiles the SMs are already busy and the partials'
        round trip costs 0.5-4 us;
      - up to 2048 rows (o_proj, MLA's kv_a, shared experts' down): 16 rows per program, K steps of 256
        (o_proj 2048x2048 5.24 us against 5.98; kv_a 576x2048 4.64 against 5.17);
      - up to 4095 rows (qkv, MLA's q): 64 rows, steps of 256 (3072x2048 6.07 against 6.43);
      - rows longer than 4096, or 4096 x 4096 (Llama-3-8B's down and o_proj): 32 rows, steps of 512 (4096x14336
        29.6 against 31.7);
      - more (gate/up, qkv and LM heads of rows up to 4096 long): 64 rows, steps of 128 (gate/up 16384x2048 18.1
        against 20.0; Llama-3-8B's 28672x4096 56.7 against 61-63 with 32 x 512, its qkv 6144x4096 14.9). Until
        session 20 Llama-3-8B's gate/up, qkv and LM head took 32 x 512: its decode steps at batch 2 / 8 / 16 were
        4.95 / 5.40 / 5.37 ms then, 4.36 / 4.68 / 5.09 ms with these (session20_steps_ab_h200.json). Wide weights
        of rows longer than 4096 (DeepSeek-V3's LM head) keep 32 x 512: not measured;
    4 warps, 4 stages. Short rows get a K step of their own length at most."""
    if n < WIDE_N and k >= SPLIT_K_MIN_K:
        return SkinnyTiles(64, 256, 4, 4, split_k=4)
    if n <= 2048:
        block_n, block_k = 16, 256
    elif n < 4096:
        block_n, block_k = 64, 256
    elif k > 4096 or (k == 4096 and n == 4096):
        block_n, block_k = 32, 512
    else:
        block_n, block_k = 64, 128
    return SkinnyTiles(block_n, min(block_k, max(16, next_pow2(k))), 4, 4)


def skinny_max_rows(n: int, k: int) -> int:
    """The most activation rows the skinny GEMM takes for an [n, k] weight: 32, except 16 for narrow weights of
    rows longer than SHORT_K and shorter than SPLIT_K_MIN_K (DeepSeek-V2-Lite's shared experts' down, 2048 x 2816).
    Measured in decode steps on an H200 (benchmarks/h200_decode_sweep.py --skinny-max-rows):
      - session 19 (skinny_rows_ab_h200.json): 32 rows for every weight made Llama-3.2-1B's batch-32 step faster
        (1.48 against 1.60 ms) and Llama-3-8B's slower (6.72 against 6.15), Qwen3-MoE's too (5.46 against 5.38).
        With 32 rows only up to 2048-long rows, the step was faster or the same in all 12 comparisons at batch 24
        and 32 (1B b24 1.42-1.48 against 1.52 ms, V2-Lite b32 8.76-8.79 against 8.95, Qwen3-MoE b32 5.26-5.28
        against 5.30).
      - session 21 (session21_steps_ab_h200.json), after session 20 gave Llama-3-8B's wide weights (gate/up,
        qkv, LM head) 64 x 128 tiles in place of 32 x 512: 32 rows for every weight made Llama-3-8B's batch-32 step
        faster, 5.93 against 6.06 ms (graph replay 5.61 against 5.96), batch 64 (cuBLAS either way) 7.61 / 7.60.
      - session 25 (session25_steps_ab_h200.json): the split-K weights (Qwen3-MoE's o_proj, Llama-3.2-1B's down)
        take 32 rows too; alone at 32 rows they run 7.1 and 11.5 us against cuBLAS's 9.6 and 14.0.
    Alone, at 17-32 rows, the unsplit kernel and cuBLAS are about as fast (tune_skinny_gemm_grid.json); the likely
    source of the gain (not measured apart) is the launch chain: this one starts under PDL, cuBLAS does not."""
    short_or_wide = k <= SHORT_K or n >= WIDE_N or k >= SPLIT_K_MIN_K
    return SKINNY_MAX_ROWS_SHORT_K if short_or_wide else SKINNY_MAX_ROWS


def skinny_wide_tiles(n: int, k: int, swiglu: bool) -> Optional[SkinnyTiles]:
    """The tiles for 33-64 rows of an [n, k] weight under DEEPSERVE_SKINNY_64_ROWS, None where cuBLAS stays. Timed
    alone on an H100 at 64 rows of Llama-3.2-1B's weights (tune_skinny_64rows_h100_s35.json, us, the skinny GEMM's
    best against cuBLAS): the gate/up weight with the SwiGLU in the epilogue (16384 x 2048) 25.3 against cuBLAS +
    SiLU-and-mul's 29.6, with 128-row tiles and 8 warps; the split-K down (2048 x 8192) 15.6 against 17.5; qkv and
    o_proj 8.1 / 6.6 against 7.2 / 6.5 (they stay on cuBLAS). The engine's tiles for every weight at 64 rows made
    decode steps slower (skinny_rows_64_h100_s35.json: Llama-3.2-1B batch 64 at 1k 2.31 -> 2.41 ms). This rule's
    steps (ms, off -> on): Llama-3.2-1B batch 64 at 1k 2.298 -> 2.237 (skinny_64_rows_ab_h100_s35.json); the MoE
    shapes unchanged within 0.3% (skinny_64_rows_moe_ab_h100_s36.json: Qwen3-MoE batch 48 / 64 7.885 / 8.163 ->
    7.861 / 8.169, V2-Lite 12.268 / 12.607 -> 12.278 / 12.616). K steps are half these at more than 32 rows
    (`_launch`)."""
    if swiglu and k <= SHORT_K:
        return SkinnyTiles(128, 256, 8, 3)
    if n < WIDE_N and k >= SPLIT_K_MIN_K:
        return SkinnyTiles(64, 256, 4, 4, split_k=4)
    return None


def skinny_applies(x: torch.Tensor, weight: torch.Tensor, swiglu: bool = False) -> bool:
    """x [M, K] with 2 <= M <= skinny_max_rows(N, K) of weight's half-precision dtype, no autograd (the caller
    checked the device); under DEEPSERVE_SKINNY_64_ROWS also 33-64 rows of the weights `skinny_wide_tiles` names
    (`swiglu`: weight is a gate/up one whose SwiGLU runs in the epilogue)."""
    if not (x.dim() == 2 and weight.dim() == 2 and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and not torch.is_grad_enabled()):
        return False
    rows = x.shape[0]
    if 2 <= rows <= skinny_max_rows(*weight.shape):
        return True
    return WIDE_ROWS and 32 < rows <= WIDE_MAX_ROWS and skinny_wide_tiles(*weight.shape, swiglu) is not None


def _tiles(rows: int, n: int, k: int, swiglu: bool) -> SkinnyTiles:
    """The launch's tiles: `skinny_wide_tiles` past 32 rows where it names some, else `skinny_tiles`."""
    wide = skinny_wide_tiles(n, k, swiglu) if rows > 32 else None
    return wide or skinny_tiles(n, k)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                  tiles: Optional[SkinnyTiles] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [M, K], weight [N, K] (same dtype), bias [N] or None -> [M, N] = F.linear(x, weight, bias); written into
    `out` ([M, N] of x's dtype, contiguous) when given."""
    x, weight = _operands(x, weight)
    n, k = weight.shape
    if out is None:
        y = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    else:
        assert out.shape == (x.shape[0], n) and out.dtype == x.dtype and out.is_contiguous()
        y = out
    if bias is not None:
        assert bias.shape == (n,) and bias.is_contiguous()
    _launch(x, weight, bias, y, n, tiles or _tiles(x.shape[0], n, k, False), swiglu=False, limit=None)
    return y


def skinny_swiglu(x: torch.Tensor, w13: torch.Tensor, limit: Optional[float] = None,
                  tiles: Optional[SkinnyTiles] = None) -> torch.Tensor:
    """x [M, K], w13 [2I, K] (gate rows then up rows) -> [M, I] = swiglu_activation(F.linear(x, w13), limit)."""
    x, w13 = _operands(x, w13)
    two_i, k = w13.shape
    assert two_i % 2 == 0
    act = torch.empty(x.shape[0], two_i // 2, dtype=x.dtype, device=x.device)
    _launch(x, w13, None, act, two_i // 2, tiles or _tiles(x.shape[0], two_i, k, True), swiglu=True, limit=limit)
    return act


def _operands(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    require_triton(x)
    assert x.dim() == 2 and x.shape[1] == weight.shape[1] and x.dtype == weight.dtype, \
        f"skinny GEMM: x {tuple(x.shape)} {x.dtype} against weight {tuple(weight.shape)} {weight.dtype}"
    return (x if x.stride(-1) == 1 else x.contiguous()), (weight if weight.stride(-1) == 1 else weight.contiguous())


def skinny_linear_two(x: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor,
                      tiles: Optional[SkinnyTiles] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K], weights [Na, K] and [Nb, K] (x's dtype) -> (F.linear(x, weight_a), F.linear(x, weight_b)) in one
    launch: the programs of weight_b follow weight_a's, with the tiling of their stacked [Na + Nb, K] shape. One
    launch instead of two where two projections read the same rows (MLA's q and kv_a: the second, 576 x 2048 in
    DeepSeek-V2-Lite, is a launch's fixed cost for 2.4 MB)."""
    x, weight_a = _operands(x, weight_a)
    x, weight_b = _operands(x, weight_b)
    (n_a, k), n_b = weight_a.shape, weight_b.shape[0]
    if min(n_a, n_b, k) < 2:
        # Triton compiles an int argument equal to 1 as a constant, which the kernel's switch to the second
        # weight's sizes and strides cannot reassign: such shapes take a launch each.
        return skinny_linear(x, weight_a, tiles=tiles), skinny_linear(x, weight_b, tiles=tiles)
    y_a = torch.empty(x.shape[0], n_a, dtype=x.dtype, device=x.device)
    y_b = torch.empty(x.shape[0], n_b, dtype=x.dtype, device=x.device)
    _launch(x, weight_a, None, y_a, n_a, tiles or skinny_tiles(n_a + n_b, k), swiglu=False, limit=None,
            second=(weight_b, y_b))
    return y_a, y_b


def split_counters(device: torch.device) -> Optional[torch.Tensor]:
    """The device's split-K tile counters (SPLIT_COUNTERS int32 zeros), made on first use; None while a CUDA graph
    is being captured and none exist yet (a captured zero fill would only run at replay)."""
    counters = _split_counters.get(device)
    if counters is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        counters = _split_counters[device] = torch.zeros(SPLIT_COUNTERS, dtype=torch.int32, device=device)
    return counters


def rows_tiles(rows: int, tiles: SkinnyTiles) -> tuple[int, SkinnyTiles]:
    """(BLOCK_M, tiles) of a launch over `rows` activation rows: rows padded to a power of two of at least 16 (an
    MMA's side); past 32 rows (DEEPSERVE_SKINNY_64_ROWS or h200_decode_sweep.py --skinny-max-rows)
    half the K step, so that four stages of the weight and activation tiles fit in shared memory (64 x 256 tiles
    at 64 rows need 256 KB)."""
    block_m = max(16, next_pow2(rows))
    if block_m > 32:
        tiles = tiles._replace(block_k=max(16, tiles.block_k // 2))
    return block_m, tiles


def _k_split(k: int, tiles: SkinnyTiles, num_tiles: int, device: torch.device):
    """(parts, K elements per part, counters) of a launch: whole K steps per part, no empty part; one part when
    the tiling asks for none, the tiles outnumber the counters, or the counters cannot be made now."""
    parts = min(tiles.split_k, triton.cdiv(k, tiles.block_k))
    counters = split_counters(device) if parts > 1 and num_tiles <= SPLIT_COUNTERS else None
    if counters is None:
        return 1, k, None
    per_part = triton.cdiv(triton.cdiv(k, parts), tiles.block_k) * tiles.block_k
    return triton.cdiv(k, per_part), per_part, counters


def _launch(x, weight, bias, y, n_out: int, tiles: SkinnyTiles, swiglu: bool, limit: Optional[float],
            second: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> None:
    k = weight.shape[1]
    rows_per_program = tiles.block_n // 2 if swiglu else tiles.block_n
    programs = triton.cdiv(n_out, rows_per_program)
    w2, y2 = second if second is not None else (weight, y)
    programs_second = triton.cdiv(w2.shape[0], rows_per_program) if second is not None else 0
    num_tiles = programs + programs_second
    block_m, tiles = rows_tiles(x.shape[0], tiles)
    parts, per_part, counters = _k_split(k, tiles, num_tiles, x.device)
    if parts > 1:
        partials = torch.empty(parts, num_tiles, tiles.block_n, block_m, dtype=torch.float32, device=x.device)
    else:
        partials, counters = y, y       # not read: SPLIT_K == 1
    _skinny_kernel[(num_tiles, parts)](
        x, weight, bias if bias is not None else y, y, x.shape[0], n_out, k, x.stride(0), weight.stride(0),
        y.stride(0), float(limit or 0.0), w2, y2, w2.shape[0], w2.stride(0), y2.stride(0), programs,
        partials, counters, per_part,
        HAS_BIAS=bias is not None, SWIGLU=swiglu, HAS_LIMIT=limit is not None, TWO=second is not None,
        ACCURATE_EXP=USE_LIBDEVICE, EVEN_K=k % tiles.block_k == 0, BLOCK_M=block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, PREFETCH=tiles.prefetch, SPLIT_K=parts,
        num_warps=tiles.warps, num_stages=tiles.stages, **pdl_launch_args(x))


__all__ = ["SKINNY_MAX_ROWS", "SKINNY_MAX_ROWS_SHORT_K", "SHORT_K", "SPLIT_COUNTERS", "SPLIT_K_MIN_K",
           "WIDE_MAX_ROWS", "WIDE_N", "WIDE_ROWS", "SkinnyTiles", "rows_tiles", "skinny_applies", "skinny_linear",
           "skinny_linear_two", "skinny_max_rows", "skinny_swiglu", "skinny_tiles", "skinny_wide_tiles",
           "split_counters"]
