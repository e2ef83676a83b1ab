"""The two per-head weight products of multi-head latent attention's absorbed decode (DeepSeek-V2/V3), for small
batches: W_UK folded into the query and W_UV applied to the attention's latent output.

    absorb_query:   q_lat[b, h, r] = sum_n q_nope[b, h, n] * W_UK[h, n, r]     [B, H, N] x [H, N, R] -> [B, H, R]
    expand_values:  out[b, h, v]   = sum_r out_lat[b, h, r] * W_UV[h, v, r]    [B, H, R] x [H, V, R] -> [B, H, V]

N = qk_nope_head_dim, V = v_head_dim (128 each), R = kv_lora_rank (512). W_UK and W_UV are views of one weight kv_b
[H * (N + V), R] (R contiguous; head h's rows are W_UK[h] then W_UV[h]: `MLAWeights` in deepserve/layers/mla.py).

Why: TritonMLA._decode did these as two cuBLAS bmm calls. At batch 1 on an H200 each takes ~3.4 us for 2 MB of
weights (~0.5 us at HBM speed): 181 us per step over the 27 layers of DeepSeek-V2-Lite (H = 16). Both are
weight-streaming products at small B, i.e. GEMVs with per-head activations, written here as such. Measured in the
batch-1 step of that shape (benchmarks/pdl_prefetch_ab.json's run, without PDL): absorb_query 2.6 us, expand_values
2.3 us per layer (134 us per step instead of 181); with PDL most of that latency overlaps the kernel before.

Arithmetic contract (every kernel): exact products of the inputs (bf16/fp16 on the tensor cores; float32 inputs
widened, no TF32), float32 accumulation, one rounding to the output dtype at the end: what cuBLAS computes, up to
the summation order.

absorb_query reduces over W_UK's rows (strided by R), R contiguous: a program takes one head and BLOCK_R columns,
walks N in BLOCK_N-row steps into a [BLOCK_N, BLOCK_R] float32 accumulator and reduces it once per output row.
expand_values is a GEMV over contiguous R per head (gemv.py's `gemv_rows` arithmetic and tiling, `gemv_config`): a
program takes one head and a few rows v of W_UV, [rows, BLOCK_K] accumulator reduced once per output row.

Batch rows, up to MAX_ABSORB_BATCH (the GEMVs): every program handles all B rows of its head in a loop. Its first
weight tile (with N = 128 and R = 512 the whole slab the program needs) is loaded once, before the PDL wait, and
stays in registers for every row; the next row's activations are prefetched while the current row is reduced and
stored. Putting b on a grid axis instead would stream the 2 MB weight once per row (B x 2 MB through L2 per
product) for no saving on the per-row latency. The price is serial per-row work in a program (a multiply over the
tile, one cross-lane reduction, a store), ~1.6 us a row.

More rows (the tensor-core kernels, `use_mma`): the same weight tile loaded before the wait, but the batch rows,
padded to tl.dot's 16, are the product's other operand: one tl.dot per block of up to 64 (32) rows instead of a
pass per row; the row blocks are a third grid axis (each re-reads its weight tile, from L2 after the first). cuBLAS's
bmm does the same arithmetic but launches outside the PDL chain and takes ~3.5 us a product at these sizes.
Measured in DeepSeek-V2-Lite decode steps on an H200 (h200_decode_sweep.py with DEEPSERVE_MLA_ABSORB_MMA=1 / 0, in
one run): batch 16 7.46 / 7.56 ms, batch 8 5.74 / 5.73 (within the noise), 32 9.02 / 9.06; at 128 and 256 they were
2-4% slower, hence MAX_MMA_BATCH. Session 24 put the row blocks on the grid (they ran one after another in a program
before): the pair per layer at 32 / 64 rows 7.3 / 9.9 -> 5.9 / 7.0 us against cuBLAS's 7.2 / 7.3, still behind at
128 / 256 (12.8 / 24.4 against 7.7 / 8.6; mla_absorb_rows_ab_h200.json); V2-Lite steps with the cap at 64 against
16 moved within the noise (batch 32 8.44 / 8.40, batch 64 9.14 / 9.19 ms; at 256 rows 1-4% slower), so the cap
stays at 16.

Programmatic dependent launch (deepserve/kernels/pdl.py): both kernels load their first (constant) weight tile
before `pdl_wait`, read activations only after it, and let the next kernel start right after the wait.
"""

from __future__ import annotations

import torch

from deepserve.kernels import and_scalar, next_pow2, require_triton, tl, triton
from deepserve.kernels.gemv import gemv_config
from deepserve.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait

# The tiles were chosen by reasoning, not swept. The batch limits are measured (benchmarks/mla_absorb_ab.py: both
# products per layer, CUDA-graph replays, L2-cold weights, V2-Lite's kv_b). The GEMVs' serial per-row work grows by
# ~1.6 us a row (mla_absorb_ab_h200.json): 3.4 us at batch 1 against cuBLAS's bmm pair's 6.2, 5.1 / 6.9 at 2,
# 8.2 / 6.9 at 4. The tensor-core kernels (mla_absorb_mma_ab_h200.json): 4.5 us at 1, 4.6 at 2-3, 5.0 at 8, 5.2
# at 16 against cuBLAS's 6.3-7.2; 7.3 / 7.1 at 32, and behind from there while their row blocks ran serially in a
# program (9.9 / 7.2 at 64, 32.5 / 8.7 at 256); with the row blocks on the grid (session 24,
# mla_absorb_rows_ab_h200.json) 5.9 / 7.2 at 32, 7.0 / 7.3 at 64, 12.8 / 7.7 at 128.
MAX_ABSORB_BATCH = 2      # rows per head handled by the GEMVs; above, the tensor-core kernels
MAX_MMA_BATCH = 16        # rows the tensor-core kernels take; above, the backend keeps cuBLAS's bmm
ABSORB_BLOCK_R = 32       # W_UK columns per program: 64-byte row segments (4 x 16-byte loads in bf16);
                          # H = 16, R = 512 -> 16 x 16 = 256 programs (~2 per SM on 132 SMs)
ABSORB_BLOCK_N = 128      # W_UK rows per step: N = 128 in one step, i.e. an 8 KB (bf16) slab per program, all of it
                          # loaded before the PDL wait and kept in registers for every batch row
ABSORB_WARPS = 4          # [128, 32] tile over 128 threads: 32 elements (4 x 16-byte bf16 loads) per thread
MMA_BLOCK_M = 64          # absorb_query's tensor-core row block: q [64, 128] and the [64, 32] accumulator
# expand_values takes gemv.py's tiling of the [H * V, R] matrix it is at B = 1 (gemv_config; tuned there on whole
# GEMVs, not on this kernel): for V2-Lite's [2048, 512], 4 rows of one head per program, BLOCK_K 512, 1 warp ->
# 16 x 32 = 512 programs of 4 KB. Its tensor-core twin: 16 rows v of one head per program (tl.dot's minimum N),
# the whole R = 512 in one K step (a 16 KB slab loaded before the PDL wait), row blocks of at most 32 (x [32, 512]
# in bf16 is 64 registers a thread over 4 warps) -> 16 x 8 = 128 programs.
EXPAND_BLOCK_V = 16
EXPAND_BLOCK_K = 512
EXPAND_BLOCK_M = 32


@triton.jit
def _absorb_query_kernel(q_ptr, w_ptr, out_ptr, batch, n_len, r_len,
                         stride_qb, stride_qh, stride_wh, stride_wn, stride_ob, stride_oh,
                         BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr):
    """out[b, h, r-block] = q[b, h, :] @ w[h, :, r-block] for every b; program (h, r-block)."""
    h = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    n = tl.arange(0, BLOCK_N)
    r_ok = r < r_len
    n_ok = n < n_len
    w_ptrs = w_ptr + h.to(tl.int64) * stride_wh + n[:, None] * stride_wn + r[None, :]
    # Weights are constant: the first step's tile streams in while the previous kernel finishes (PDL).
    w_first = tl.load(w_ptrs, mask=n_ok[:, None] & r_ok[None, :], other=0.0)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    q_head = q_ptr + h.to(tl.int64) * stride_qh
    out_head = out_ptr + h.to(tl.int64) * stride_oh + r
    q = tl.load(q_head + n, mask=n_ok, other=0.0)                       # row 0 (the launcher skips batch 0)
    for b in range(batch):
        # Prefetch row b + 1's first step while row b is reduced and stored.
        q_next = tl.load(q_head + (b + 1) * stride_qb + n, mask=and_scalar(n_ok, b + 1 < batch), other=0.0)
        acc = w_first.to(tl.float32) * q.to(tl.float32)[:, None]
        for n0 in range(BLOCK_N, n_len, BLOCK_N):                      # N > BLOCK_N only
            step_ok = n < n_len - n0
            w = tl.load(w_ptrs + n0 * stride_wn, mask=step_ok[:, None] & r_ok[None, :], other=0.0)
            q_step = tl.load(q_head + b * stride_qb + n0 + n, mask=step_ok, other=0.0)
            acc += w.to(tl.float32) * q_step.to(tl.float32)[:, None]
        tl.store(out_head + b * stride_ob, tl.sum(acc, 0).to(out_ptr.dtype.element_ty), mask=r_ok)
        q = q_next


@triton.jit
def _expand_values_kernel(x_ptr, w_ptr, out_ptr, batch, v_len, r_len,
                          stride_xb, stride_xh, stride_wh, stride_wv, stride_ob, stride_oh,
                          ROWS: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    """out[b, h, v-block] = w[h, v-block, :] @ x[b, h, :] for every b; program (h, v-block). gemv_rows's
    arithmetic with its first K step hoisted out of the batch loop (kept in registers for every row)."""
    h = tl.program_id(0)
    v = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    k = tl.arange(0, BLOCK_K)
    v_ok = v < v_len
    k_ok = k < r_len
    w_ptrs = w_ptr + h.to(tl.int64) * stride_wh + v[:, None] * stride_wv + k[None, :]
    w_first = tl.load(w_ptrs, mask=v_ok[:, None] & k_ok[None, :], other=0.0)     # constant: before the wait
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    x_head = x_ptr + h.to(tl.int64) * stride_xh
    out_head = out_ptr + h.to(tl.int64) * stride_oh + v
    x = tl.load(x_head + k, mask=k_ok, other=0.0)                       # row 0 (the launcher skips batch 0)
    for b in range(batch):
        x_next = tl.load(x_head + (b + 1) * stride_xb + k, mask=and_scalar(k_ok, b + 1 < batch), other=0.0)
        acc = w_first.to(tl.float32) * x.to(tl.float32)[None, :]
        for k0 in range(BLOCK_K, r_len, BLOCK_K):                      # R > BLOCK_K only
            step_ok = k < r_len - k0
            w = tl.load(w_ptrs + k0, mask=v_ok[:, None] & step_ok[None, :], other=0.0)
            x_step = tl.load(x_head + b * stride_xb + k0 + k, mask=step_ok, other=0.0)
            acc += w.to(tl.float32) * x_step.to(tl.float32)[None, :]
        tl.store(out_head + b * stride_ob, tl.sum(acc, 1).to(out_ptr.dtype.element_ty), mask=v_ok)
        x = x_next



@triton.jit
def _absorb_query_mma_kernel(q_ptr, w_ptr, out_ptr, batch, n_len, r_len,
                             stride_qb, stride_qh, stride_wh, stride_wn, stride_ob, stride_oh,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                             PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    """out[m-block, h, r-block] = q[m-block, h, :] @ w[h, :, r-block] on the tensor cores; program (h, r-block,
    m-block). The first N step's weight tile (with N = 128 the whole slab) loads before the PDL wait."""
    h = tl.program_id(0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    n = tl.arange(0, BLOCK_N)
    r_ok = r < r_len
    w_ptrs = w_ptr + h.to(tl.int64) * stride_wh + n[:, None] * stride_wn + r[None, :]
    w_first = tl.load(w_ptrs, mask=(n < n_len)[:, None] & r_ok[None, :], other=0.0)     # constant: before the wait
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < batch
    q_rows = q_ptr + h.to(tl.int64) * stride_qh + m[:, None].to(tl.int64) * stride_qb
    q = tl.load(q_rows + n[None, :], mask=m_ok[:, None] & (n < n_len)[None, :], other=0.0)
    acc = tl.dot(q, w_first, input_precision=PRECISION)                           # [BLOCK_M, BLOCK_R]
    for n0 in range(BLOCK_N, n_len, BLOCK_N):                                     # N > BLOCK_N only
        step_ok = n < n_len - n0
        w = tl.load(w_ptrs + n0 * stride_wn, mask=step_ok[:, None] & r_ok[None, :], other=0.0)
        q = tl.load(q_rows + n0 + n[None, :], mask=m_ok[:, None] & step_ok[None, :], other=0.0)
        acc = tl.dot(q, w, acc, input_precision=PRECISION)
    tl.store(out_ptr + m[:, None].to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + r[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_values_mma_kernel(x_ptr, w_ptr, out_ptr, batch, v_len, r_len,
                              stride_xb, stride_xh, stride_wh, stride_wv, stride_ob, stride_oh,
                              BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                              PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    """out[m-block, h, v-block] = x[m-block, h, :] @ w[h, v-block, :]^T on the tensor cores; program (h, v-block,
    m-block). The first K step's weight tile (with R = 512 the whole slab) loads before the PDL wait."""
    h = tl.program_id(0)
    v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    k = tl.arange(0, BLOCK_K)
    v_ok = v < v_len
    w_ptrs = w_ptr + h.to(tl.int64) * stride_wh + v[:, None] * stride_wv + k[None, :]
    w_first = tl.load(w_ptrs, mask=v_ok[:, None] & (k < r_len)[None, :], other=0.0)     # constant: before the wait
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = m < batch
    x_rows = x_ptr + h.to(tl.int64) * stride_xh + m[:, None].to(tl.int64) * stride_xb
    x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & (k < r_len)[None, :], other=0.0)
    acc = tl.dot(x, tl.trans(w_first), input_precision=PRECISION)                  # [BLOCK_M, BLOCK_V]
    for k0 in range(BLOCK_K, r_len, BLOCK_K):                                     # R > BLOCK_K only
        step_ok = k < r_len - k0
        w = tl.load(w_ptrs + k0, mask=v_ok[:, None] & step_ok[None, :], other=0.0)
        x = tl.load(x_rows + k0 + k[None, :], mask=m_ok[:, None] & step_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    tl.store(out_ptr + m[:, None].to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + v[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & v_ok[None, :])

def absorb_supported(batch: int) -> bool:
    """Whether `absorb_query` / `expand_values` should replace the bmm pair for `batch` decode rows: 1 to
    MAX_MMA_BATCH. Up to MAX_ABSORB_BATCH rows they run as GEMVs, above it as tensor-core GEMMs (`use_mma`)."""
    return 1 <= batch <= MAX_MMA_BATCH


def use_mma(batch: int) -> bool:
    """The tensor-core kernels for `batch` rows: past MAX_ABSORB_BATCH, where the GEMVs' serial per-row work costs
    more than tl.dot's padding rows."""
    return batch > MAX_ABSORB_BATCH


def absorb_config(n: int, r: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_R, warps) of `absorb_query` for W_UK [H, n, r] (both kernels)."""
    return max(16, min(ABSORB_BLOCK_N, next_pow2(n))), max(16, min(ABSORB_BLOCK_R, next_pow2(r))), ABSORB_WARPS


def mma_rows(batch: int, cap: int) -> int:
    """BLOCK_M of the tensor-core kernels: the batch padded to tl.dot's 16 rows and up, at most `cap` a block."""
    return min(cap, max(16, next_pow2(batch)))


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"      # fp32 inputs: exact products, no TF32 rounding


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor, mma: bool | None = None) -> torch.Tensor:
    """q_nope [B, H, N] (any strides), w_uk [H, N, R] (q_nope's dtype; e.g. a view of kv_b) -> q_lat [B, H, R],
    contiguous, q_nope's dtype: `absorb_query_ref` up to the float32 summation order. `mma` forces the kernel
    (tensor cores or GEMV; default `use_mma(B)`)."""
    require_triton(q_nope)
    bsz, heads, n = q_nope.shape
    assert w_uk.dim() == 3 and tuple(w_uk.shape[:2]) == (heads, n), \
        f"w_uk {tuple(w_uk.shape)} does not match q_nope {tuple(q_nope.shape)}"
    assert w_uk.dtype == q_nope.dtype, f"dtypes differ: q_nope {q_nope.dtype}, w_uk {w_uk.dtype}"
    rank = w_uk.shape[2]
    q_nope, w_uk = _unit_last(q_nope), _unit_last(w_uk)
    q_lat = torch.empty(bsz, heads, rank, dtype=q_nope.dtype, device=q_nope.device)
    if bsz == 0 or heads == 0 or rank == 0:
        return q_lat
    block_n, block_r, warps = absorb_config(n, rank)
    args = (q_nope, w_uk, q_lat, bsz, n, rank, q_nope.stride(0), q_nope.stride(1), w_uk.stride(0), w_uk.stride(1),
            q_lat.stride(0), q_lat.stride(1))
    grid = (heads, triton.cdiv(rank, block_r))
    if use_mma(bsz) if mma is None else mma:
        block_m = mma_rows(bsz, MMA_BLOCK_M)
        _absorb_query_mma_kernel[grid + (triton.cdiv(bsz, block_m),)](
            *args, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, PRECISION=_precision(q_nope.dtype),
            num_warps=warps, **pdl_launch_args(q_nope))
    else:
        _absorb_query_kernel[grid](*args, BLOCK_N=block_n, BLOCK_R=block_r, num_warps=warps,
                                   **pdl_launch_args(q_nope))
    return q_lat


def expand_values(out_lat: torch.Tensor, w_uv: torch.Tensor, out: torch.Tensor,
                  mma: bool | None = None) -> torch.Tensor:
    """out_lat [B, H, R] (any strides; in the backend a transposed view of [H, B, R]), w_uv [H, V, R] (e.g. a view
    of kv_b) -> writes out [B, H, V] (a given tensor, unit last stride; all three of one dtype) and returns it:
    `expand_values_ref` up to the float32 summation order. `mma` as in `absorb_query`."""
    require_triton(out_lat)
    bsz, heads, rank = out_lat.shape
    assert w_uv.dim() == 3 and w_uv.shape[0] == heads and w_uv.shape[2] == rank, \
        f"w_uv {tuple(w_uv.shape)} does not match out_lat {tuple(out_lat.shape)}"
    v_dim = w_uv.shape[1]
    assert tuple(out.shape) == (bsz, heads, v_dim), f"out {tuple(out.shape)}, expected {(bsz, heads, v_dim)}"
    assert out_lat.dtype == w_uv.dtype == out.dtype, f"dtypes differ: {out_lat.dtype}, {w_uv.dtype}, {out.dtype}"
    assert out.stride(-1) == 1, "out needs a unit stride along V"
    out_lat, w_uv = _unit_last(out_lat), _unit_last(w_uv)
    if bsz == 0 or heads == 0 or v_dim == 0:
        return out
    args = (out_lat, w_uv, out, bsz, v_dim, rank, out_lat.stride(0), out_lat.stride(1), w_uv.stride(0),
            w_uv.stride(1), out.stride(0), out.stride(1))
    if use_mma(bsz) if mma is None else mma:
        block_m = mma_rows(bsz, EXPAND_BLOCK_M)
        _expand_values_mma_kernel[(heads, triton.cdiv(v_dim, EXPAND_BLOCK_V), triton.cdiv(bsz, block_m))](
            *args, BLOCK_M=block_m, BLOCK_V=EXPAND_BLOCK_V,
            BLOCK_K=max(16, min(EXPAND_BLOCK_K, next_pow2(rank))), PRECISION=_precision(out.dtype),
            num_warps=ABSORB_WARPS, **pdl_launch_args(out_lat))
    else:
        rows, block_k, warps = gemv_config(heads * v_dim, rank)
        _expand_values_kernel[(heads, triton.cdiv(v_dim, rows))](
            *args, ROWS=rows, BLOCK_K=block_k, num_warps=warps, **pdl_launch_args(out_lat))
    return out


def absorb_query_ref(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """TritonMLA._decode's cuBLAS form: [B, H, R] (a heads-major view)."""
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)


def expand_values_ref(out_lat: torch.Tensor, w_uv: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """TritonMLA._decode's cuBLAS form, written through a heads-major view of `out`."""
    torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))
    return out


__all__ = ["MAX_ABSORB_BATCH", "MAX_MMA_BATCH", "absorb_config", "absorb_query", "absorb_query_ref", "absorb_supported",
           "expand_values", "expand_values_ref", "use_mma"]
