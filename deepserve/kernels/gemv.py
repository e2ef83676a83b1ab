"""GEMV on the GPU: y = x W^T (+ bias) (+ residual) for one activation row, the product of every linear layer in a
batch-1 decode step; optionally of rms_norm(x) (the norm in the GEMV's prologue). The GPU twin of `F.linear` at
M = 1 (deepserve/layers/linear.py dispatches to it).

Batch-1 decode only reads weights; at M = 1 cuBLAS picks latency-bound kernels (split-K plus a reduce kernel for
long rows) that reach 1.4-2.6 TB/s on a Llama-3.2-1B layer's matrices on an H200. Here each program takes a few
weight rows and either holds them whole in one K step (rows of up to 2048: the tile is loaded into registers
before the PDL wait, so after the previous kernel ends only x remains to load) or walks K in 512-element steps,
summing products into a [rows, BLOCK_K] float32 accumulator that is reduced once at the end (no cross-lane
reduction per step). Measured in CUDA-graph chains with PDL, L2-cold weights (benchmarks/tune_gemv_wide.json):
qkv 3072x2048 4.6 us vs cuBLAS 6.1, o_proj 2048x2048 3.3 vs 6.0, down 2048x8192 9.2 vs 13.6, gate/up 16384x2048
16.8 vs 18.1, lm_head 128256x2048 116.9 vs 121.5.

Products are exact in float32 (inputs widened, not TF32), accumulated in float32, rounded once to x's dtype: the
same as cuBLAS up to the summation order.
"""

from __future__ import annotations

from typing import Optional

import torch

from deepserve import envs
from deepserve.kernels import HAS_TRITON, INTERPRET, USE_LIBDEVICE, next_pow2, require_triton, tl, triton
from deepserve.kernels.activation import silu_and_mul, silu_mul
from deepserve.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait
from deepserve.kernels.reference.activation import swiglu as swiglu_reference
from deepserve.kernels.reference.norm import rms_norm

# What a GEMV program does with its weights before the PDL wait (an H200 A/B, DEEPSERVE_GEMV_PREFETCH): 0 nothing,
# 1 an L2 prefetch of its first K step, 2 an L2 prefetch of all its rows, 3 its first K step into registers.
PDL_PREFETCH = tl.constexpr(envs.DEEPSERVE_GEMV_PREFETCH) if HAS_TRITON else 0


@triton.jit
def prefetch_rows_to_l2(w_ptr, rows, rows_ok, length, stride_wn, BLOCK_K: tl.constexpr):
    """Ask L2 for w[rows[r], :length] of a row-major matrix, one `prefetch.global.L2` per 128-byte line, and move
    on: no register waits for the data, which the K loop then reads from L2."""
    STEP: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth        # elements per 128-byte line
    LINES: tl.constexpr = max(BLOCK_K // STEP, 1)                                  # lines per BLOCK_K step
    col = tl.arange(0, LINES) * STEP
    row_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn
    for k0 in range(0, length, LINES * STEP):
        ok = rows_ok[:, None] & (col[None, :] < length - k0)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [row_ptrs + k0 + col[None, :], ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def gemv_rows(x_ptr, w_ptr, rows, rows_ok, length, stride_wn, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """[R] float32: w[rows[r], :length] . x[:length] for R rows of a row-major matrix (K contiguous).

    The products go into an [R, BLOCK_K] float32 accumulator that is reduced once after the K loop: no cross-lane
    reduction inside the loop, and fp32 inputs get exact fp32 products (no TF32). Shared with the fused MoE's pair
    mode and the router.

    With USE_PDL the program may touch its weight rows before it waits for the previous kernel (`pdl_wait`):
    weights are constant, so they can stream in while that kernel finishes (PDL_PREFETCH says how). The caller's
    `rows` must then not depend on a previous kernel's output; a caller whose rows do (the MoE pair kernels read
    expert ids) waits itself and passes False."""
    k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + k[None, :]
    if USE_PDL and PDL_PREFETCH == 3:
        # The first K step's weights into registers before the wait; the loop takes the rest.
        k_ok = k < length
        w = tl.load(w_ptrs, mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
        pdl_wait(USE_PDL)
        pdl_launch_dependents(USE_PDL)
        x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        acc = w.to(tl.float32) * x[None, :]
        w_ptrs += BLOCK_K
        first = BLOCK_K
    else:
        if USE_PDL and PDL_PREFETCH == 1:      # L2: the first K step
            prefetch_rows_to_l2(w_ptr, rows, rows_ok, tl.minimum(length, BLOCK_K), stride_wn, BLOCK_K)
        if USE_PDL and PDL_PREFETCH == 2:      # L2: all of the program's rows
            prefetch_rows_to_l2(w_ptr, rows, rows_ok, length, stride_wn, BLOCK_K)
        pdl_wait(USE_PDL)
        pdl_launch_dependents(USE_PDL)
        acc = tl.zeros(w_ptrs.shape, tl.float32)
        first = 0
    for k0 in range(first, length, BLOCK_K):
        k_ok = k < length - k0
        x = tl.load(x_ptr + k0 + k, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=rows_ok[:, None] & k_ok[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
        w_ptrs += BLOCK_K
    return tl.sum(acc, 1)


@triton.jit
def one_step_rows(x_ptr, norm_ptr, eps, w_ptr, rows, rows_ok, length, stride_wn, NORM: tl.constexpr,
                  BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """`gemv_rows` when one K step holds the whole row (BLOCK_K >= length), of rms_norm(x) * norm weight when NORM.

    The program's whole weight tile (and the norm weight) goes into registers before the PDL wait, and x is a
    single load after it: one round trip to L2 once the previous kernel ends. With NORM the RMSNorm that feeds the
    projection runs here, on the x loaded anyway (its statistics are a register reduction), so it costs no launch:
    x is the residual stream, normalised with the RMSNorm kernel's arithmetic (kernels/norm.py)."""
    k = tl.arange(0, BLOCK_K)
    k_ok = k < length
    w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + k[None, :], mask=rows_ok[:, None] & k_ok[None, :],
                other=0.0)                                         # constant: before the wait
    if NORM:
        weight = tl.load(norm_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
    if NORM:
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / length + eps)
        x = (weight * (xf * rstd).to(x.dtype).to(tl.float32)).to(x.dtype)
    return tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], 1)


@triton.jit
def normed_gemv_rows(x_ptr, norm_ptr, eps, w_ptr, rows, rows_ok, length, stride_wn, NORM: tl.constexpr,
                     BLOCK_K: tl.constexpr, ONE_STEP: tl.constexpr, USE_PDL: tl.constexpr):
    """`one_step_rows` where one K step holds the row (ONE_STEP), else `gemv_rows` (no NORM there: the norm would
    cost a round trip to L2 before the first step; `prologue_norm` runs it as a kernel instead)."""
    if ONE_STEP:
        return one_step_rows(x_ptr, norm_ptr, eps, w_ptr, rows, rows_ok, length, stride_wn, NORM, BLOCK_K, USE_PDL)
    else:
        tl.static_assert(not NORM, "an RMSNorm prologue needs a one-step GEMV")
        return gemv_rows(x_ptr, w_ptr, rows, rows_ok, length, stride_wn, BLOCK_K, USE_PDL)


@triton.jit
def swiglu(gate, up, limit, HAS_LIMIT: tl.constexpr):
    """silu(gate) * up in float32. DeepSeek-V4.1's clamp first: gate from above, up on both sides (as
    swiglu_activation)."""
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def gate_up_rows(x_ptr, norm_ptr, eps, w_ptr, col0, inter, length, stride_wn, NORM: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ONE_STEP: tl.constexpr, USE_PDL: tl.constexpr):
    """([BLOCK_N], [BLOCK_N]) float32: (x . w[n], x . w[inter + n]) for columns n = col0 .. col0 + BLOCK_N of a
    [2 * inter, K] gate-then-up weight (x RMS-normalised first when NORM: `normed_gemv_rows`). Gate and up rows are
    interleaved in one [2 * BLOCK_N, BLOCK_K] tile, so one K loop streams both and the result splits into
    (gate, up) pairs: the activation never goes through memory."""
    r = tl.arange(0, 2 * BLOCK_N)
    col = col0 + r // 2
    rows = col + (r % 2) * inter
    gate_up = normed_gemv_rows(x_ptr, norm_ptr, eps, w_ptr, rows, col < inter, length, stride_wn, NORM, BLOCK_K,
                               ONE_STEP, USE_PDL)
    return tl.split(tl.reshape(gate_up, [BLOCK_N, 2]))


@triton.jit
def swiglu_rows(x_ptr, w_ptr, col0, inter, length, stride_wn, limit,
                HAS_LIMIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N] float32: swiglu(gate, up) of `gate_up_rows`, in float32 (the fused MoE's arithmetic). The
    caller has waited for the previous kernel (its weight rows depend on the routing)."""
    gate, up = gate_up_rows(x_ptr, x_ptr, 0.0, w_ptr, col0, inter, length, stride_wn, False, BLOCK_N, BLOCK_K,
                            False, False)
    return swiglu(gate, up, limit, HAS_LIMIT)


@triton.jit
def _swiglu_gemv_kernel(x_ptr, norm_ptr, w_ptr, act_ptr, inter, k_len, stride_wn, limit, eps,
                        HAS_LIMIT: tl.constexpr, ACCURATE_EXP: tl.constexpr, NORM: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ONE_STEP: tl.constexpr, USE_PDL: tl.constexpr):
    """act = silu_and_mul(F.linear(x, w)) with the unfused path's roundings: gate and up rounded to the activation
    dtype (the GEMM's output), clamped (V4.1), then silu_mul (kernels/activation.py). A batch-1 step then gives
    the tokens a batched one does: only the GEMM's summation order differs. NORM: x is RMS-normalised first."""
    dtype = act_ptr.dtype.element_ty
    gate, up = gate_up_rows(x_ptr, norm_ptr, eps, w_ptr, tl.program_id(0) * BLOCK_N, inter, k_len, stride_wn, NORM,
                            BLOCK_N, BLOCK_K, ONE_STEP, USE_PDL)
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(act_ptr + n, silu_mul(gate, up, dtype, ACCURATE_EXP), mask=n < inter)


@triton.jit
def _gemv_kernel(x_ptr, norm_ptr, w_ptr, bias_ptr, res_ptr, y_ptr, n_rows, k_len, stride_wn, eps,
                 HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, NORM: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, ONE_STEP: tl.constexpr, USE_PDL: tl.constexpr):
    """y = F.linear(x, w, bias) (+ residual: added to the product rounded to y's dtype, then rounded again, as a
    separate add would; x RMS-normalised first when NORM)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_rows
    y = normed_gemv_rows(x_ptr, norm_ptr, eps, w_ptr, n, n_ok, k_len, stride_wn, NORM, BLOCK_K, ONE_STEP, USE_PDL)
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        y = y.to(y_ptr.dtype.element_ty).to(tl.float32) + tl.load(res_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemv_two_kernel(x_ptr, wa_ptr, wb_ptr, ya_ptr, yb_ptr, n_a, n_b, k_len, stride_wa, stride_wb, programs_a,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ONE_STEP: tl.constexpr, USE_PDL: tl.constexpr):
    """y_a = x W_a^T and y_b = x W_b^T in one grid: the first `programs_a` programs take W_a's rows, the rest W_b's
    (each program waits once, in normed_gemv_rows)."""
    pid = tl.program_id(0)
    if pid < programs_a:
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        y = normed_gemv_rows(x_ptr, x_ptr, 0.0, wa_ptr, n, n < n_a, k_len, stride_wa, False, BLOCK_K, ONE_STEP,
                             USE_PDL)
        tl.store(ya_ptr + n, y.to(ya_ptr.dtype.element_ty), mask=n < n_a)
    else:
        n = (pid - programs_a) * BLOCK_N + tl.arange(0, BLOCK_N)
        y = normed_gemv_rows(x_ptr, x_ptr, 0.0, wb_ptr, n, n < n_b, k_len, stride_wb, False, BLOCK_K, ONE_STEP,
                             USE_PDL)
        tl.store(yb_ptr + n, y.to(yb_ptr.dtype.element_ty), mask=n < n_b)


GEMV_SHAPE_CLASSES = ("many_rows", "long_rows", "short_rows")


def parse_gemv_tiling(spec: str) -> dict[str, tuple[int, int, int]]:
    """The value of DEEPSERVE_GEMV_TILING -> {shape class: (rows per program, BLOCK_K, warps)}: `long_rows=1x1024x4;
    many_rows=4x512x1` overrides those two classes of `gemv_config`'s table ("" or "default": none)."""
    tilings = {}
    for entry in filter(None, (part.strip() for part in spec.split(";"))):
        if entry == "default":
            continue
        shape_class, _, tiling = entry.partition("=")
        try:
            rows, block_k, warps = (int(v) for v in tiling.split("x"))
        except ValueError:
            rows = block_k = warps = 0
        if (shape_class not in GEMV_SHAPE_CLASSES or rows not in (1, 2, 4, 8, 16) or warps not in (1, 2, 4, 8)
                or block_k < 16 or block_k & (block_k - 1)):
            raise ValueError(f"an entry of DEEPSERVE_GEMV_TILING, {entry!r}: expected CLASS=ROWSxBLOCK_KxWARPS, "
                             f"CLASS one of {', '.join(GEMV_SHAPE_CLASSES)}, rows 1-16 and BLOCK_K (>= 16) powers of "
                             "two, warps 1, 2, 4 or 8")
        tilings[shape_class] = (rows, block_k, warps)
    return tilings


TILING_OVERRIDES = parse_gemv_tiling(envs.DEEPSERVE_GEMV_TILING)


def gemv_shape_class(n: int, k: int) -> str:
    return "many_rows" if n >= 8192 else "long_rows" if k > 2048 else "short_rows"


def gemv_config(n: int, k: int) -> tuple[int, int, int]:
    """(rows per program, BLOCK_K, warps), from an H200 sweep of 36 tilings in CUDA-graph chains with PDL
    (benchmarks/tune_gemv_wide.json), on Llama-3.2-1B and DeepSeek-V2-Lite shapes:
      - many rows (N >= 8192: gate/up projections, LM heads): 4 rows, K steps of 512, 1 warp (many small programs
        keep the most loads in flight; gate_up 16.8 us, lm_head 116.9 us);
      - long rows (K > 2048: down projections): 1 row, steps of 512, 4 warps (down 2048x8192: 9.2 us, was 11.7);
      - the rest (N < 8192, K <= 2048: qkv, o_proj, MLA's q and kv_a): 4 rows of up to 2048 in one step, 4 warps
        (o_proj 3.3 us, was 3.9; qkv 4.6, was 5.9), whose weights load into registers before the PDL wait.
    DEEPSERVE_GEMV_TILING overrides a class (a K step past the row's length takes the row in one step)."""
    shape_class = gemv_shape_class(n, k)
    if shape_class in TILING_OVERRIDES:
        rows, block_k, warps = TILING_OVERRIDES[shape_class]
        return rows, min(block_k, max(16, next_pow2(k))), warps
    if shape_class == "many_rows":
        return 4, min(512, max(16, next_pow2(k))), 1
    if shape_class == "long_rows":
        return 1, 512, 4
    return 4, max(16, next_pow2(k)), 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
         residual: Optional[torch.Tensor] = None, norm=None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [1, K], weight [N, K] (same dtype), bias [N] or None -> [1, N] = F.linear(x, weight, bias), plus `residual`
    [1, N] if given (one rounding to x's dtype before the add, one after); of `norm(x)` if `norm` (an RMSNorm: its
    `weight` in x's dtype and `eps`) is given. `out` ([1, N] of x's dtype, contiguous): written there (a CUDA graph's
    static logits: no copy launch after the LM head)."""
    x, weight = one_row_operands(x, weight)
    n, k = weight.shape
    return gemv_with(x, weight, bias, *gemv_config(n, k), residual=residual, norm=norm, out=out)


def gemv_with(x, weight, bias, block_n: int, block_k: int, warps: int, residual=None, norm=None,
              out=None) -> torch.Tensor:
    """`gemv` with a given tiling (benchmarks/tune_gemv.py sweeps these); x, weight as `one_row_operands` leaves them."""
    n, k = weight.shape
    x, norm = prologue_norm(x, norm, block_k >= k)
    if out is None:
        y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    else:
        assert out.shape == (1, n) and out.dtype == x.dtype and out.is_contiguous(), \
            f"a GEMV writes a contiguous [1, {n}] of {x.dtype}; got {tuple(out.shape)} of {out.dtype}"
        y = out
    if residual is not None:
        assert residual.shape == (1, n) and residual.dtype == x.dtype and residual.stride(-1) == 1
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, norm_weight_or(norm, x), weight, bias if bias is not None else y, residual if residual is not None else y,
        y, n, k, weight.stride(0), norm_eps(norm), HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None,
        NORM=norm is not None, BLOCK_N=block_n, BLOCK_K=block_k, ONE_STEP=block_k >= k, num_warps=warps,
        **pdl_launch_args(x))
    return y


def prologue_norm(x: torch.Tensor, norm, one_step: bool):
    """(x, norm) for a GEMV launch that may take an RMSNorm in its prologue. Only a one-step GEMV takes it: there
    the statistics come from the x it loads anyway. A multi-step one would add a round trip to L2 before its first
    step, more than the norm's own launch costs under PDL (an H200 A/B of that version: +15 us per Llama-3.2-1B
    step), so for it the norm kernel runs first and the GEMV reads its output."""
    if norm is None or one_step:
        return x, norm
    from deepserve.kernels.norm import fused_add_rms_norm
    return fused_add_rms_norm(x, None, norm.weight, norm.eps), None


def gemv_two(x: torch.Tensor, w_a: torch.Tensor, w_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, K], w_a [N_a, K], w_b [N_b, K] -> (F.linear(x, w_a), F.linear(x, w_b)) in one launch: two projections of
    one input (MLA's q and kv_a) cost one kernel's latency. The tiling is the one `gemv` gives N_a + N_b rows."""
    x, w_a = one_row_operands(x, w_a)
    _, w_b = one_row_operands(x, w_b)
    (n_a, k), n_b = w_a.shape, w_b.shape[0]
    block_n, block_k, warps = gemv_config(n_a + n_b, k)
    y_a = torch.empty(1, n_a, dtype=x.dtype, device=x.device)
    y_b = torch.empty(1, n_b, dtype=x.dtype, device=x.device)
    programs_a = triton.cdiv(n_a, block_n)
    _gemv_two_kernel[(programs_a + triton.cdiv(n_b, block_n),)](
        x, w_a, w_b, y_a, y_b, n_a, n_b, k, w_a.stride(0), w_b.stride(0), programs_a,
        BLOCK_N=block_n, BLOCK_K=block_k, ONE_STEP=block_k >= k, num_warps=warps, **pdl_launch_args(x))
    return y_a, y_b


def one_row_operands(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, K] and weight [N, K] of one dtype, each with a unit stride along K."""
    require_triton(x)
    k = weight.shape[1]
    assert x.shape == (1, k) and x.dtype == weight.dtype, f"a GEMV takes one row of {k}; got {tuple(x.shape)}"
    return (x if x.stride(-1) == 1 else x.contiguous()), (weight if weight.stride(-1) == 1 else weight.contiguous())


def norm_weight_or(norm, x: torch.Tensor) -> torch.Tensor:
    """The weight of `norm` (an RMSNorm over x's last dimension, in x's dtype) for a NORM kernel, or x as the unused
    pointer when norm is None."""
    if norm is None:
        return x
    weight = norm.weight
    assert weight.dtype == x.dtype and weight.shape == (x.shape[-1],) and weight.is_contiguous(), \
        "a GEMV's RMSNorm prologue takes a contiguous weight of x's dtype and width"
    return weight


def norm_eps(norm) -> float:
    return float(norm.eps) if norm is not None else 0.0


def swiglu_gemv(x: torch.Tensor, w13: torch.Tensor, limit: Optional[float] = None, norm=None) -> torch.Tensor:
    """x [1, K], w13 [2I, K] (gate rows then up rows, x's dtype) -> [1, I] = swiglu_activation(F.linear(x, w13), limit)
    in one launch: the gate/up GEMV with the SwiGLU in its epilogue, rounded as the two-launch path rounds; of
    `norm(x)` if `norm` (an RMSNorm) is given, the norm in the GEMV's prologue."""
    x, w13 = one_row_operands(x, w13)
    two_i, k = w13.shape
    assert two_i % 2 == 0
    inter = two_i // 2
    rows, block_k, warps = gemv_config(two_i, k)
    x, norm = prologue_norm(x, norm, block_k >= k)
    act = torch.empty(1, inter, dtype=x.dtype, device=x.device)
    block_n = max(rows // 2, 1)          # columns per program: a gate row and an up row each
    _swiglu_gemv_kernel[(triton.cdiv(inter, block_n),)](
        x, norm_weight_or(norm, x), w13, act, inter, k, w13.stride(0), float(limit or 0.0), norm_eps(norm),
        HAS_LIMIT=limit is not None, ACCURATE_EXP=USE_LIBDEVICE, NORM=norm is not None, BLOCK_N=block_n,
        BLOCK_K=block_k, ONE_STEP=block_k >= k, num_warps=warps, **pdl_launch_args(x))
    return act


def swiglu_gemv_ref(x, w13, limit=None, norm=None):
    """The unfused path: the GEMM, then the SwiGLU as a layer runs it (the SiLU-and-mul kernel on CUDA without a
    limit, else the PyTorch twin): the fused kernel must round as that path does."""
    gate_up = torch.nn.functional.linear(x if norm is None else norm_ref(x, norm), w13)
    if limit is None and gate_up.is_cuda and HAS_TRITON and not INTERPRET and not torch.is_grad_enabled():
        return silu_and_mul(gate_up)
    return swiglu_reference(gate_up, limit)


def gemv_ref(x, weight, bias=None, residual=None, norm=None):
    y = torch.nn.functional.linear(x if norm is None else norm_ref(x, norm), weight, bias)
    return y if residual is None else y + residual


def norm_ref(x, norm):
    return rms_norm(x, norm.weight, norm.eps)


__all__ = ["gate_up_rows", "gemv", "gemv_config", "gemv_ref", "gemv_rows", "gemv_two", "gemv_with", "norm_eps",
           "norm_weight_or", "normed_gemv_rows", "one_row_operands", "one_step_rows", "prologue_norm", "swiglu",
           "swiglu_gemv", "swiglu_gemv_ref", "swiglu_rows"]
