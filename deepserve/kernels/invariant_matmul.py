"""x @ w.T with one summation order per output element whatever the batch: the GPU linear layer of batch-invariant
mode (layers/batch_invariant.py; deepinfer.md section 9).

cuBLAS picks its algorithm (tile shape, split-K, stream-K) by the problem size, so a row's result changes with the
number of rows beside it. Here one fixed configuration serves every M: BLOCK_M x BLOCK_N tiles, the K loop in
BLOCK_K steps from k = 0 upwards, accumulated in float32, no split-K. Each output element is then the same
sequence of multiply-adds whichever tile and whichever batch its row is in (padding rows are zeros in other rows
of the tile and never mix with it). float32 inputs multiply in IEEE float32 (not TF32).

Twin: `invariant_linear_ref` (torch's matmul: the same meaning, not the same bits).
"""

from __future__ import annotations

import torch

from deepserve.kernels import cdiv, require_triton, tl, triton

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64
NUM_WARPS = 4


@triton.jit
def _invariant_matmul_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk,
                             stride_om, stride_on, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=(rm[:, None] < M) & (ks[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + ks[:, None] * stride_wk,
                    mask=(rn[None, :] < N) & (ks[:, None] < K), other=0.0)
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on, acc.to(out_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias) in x's dtype; every row's result independent of the other rows."""
    require_triton(x)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    m, k = x2.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        grid = (cdiv(m, BLOCK_M), cdiv(n, BLOCK_N))
        _invariant_matmul_kernel[grid](
            x2, weight, bias if bias is not None else weight, out, m, n, k, x2.stride(0), x2.stride(1),
            weight.stride(0), weight.stride(1), out.stride(0), out.stride(1), HAS_BIAS=bias is not None,
            IEEE=x.dtype == torch.float32, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, num_warps=NUM_WARPS)
    return out.reshape(*shape[:-1], n)


def invariant_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


__all__ = ["invariant_linear", "invariant_linear_ref"]
