"""RMSNorm, optionally fused with the residual add before it: one read of x (and residual), one write of the
normalised output (and of x + residual). `combine_add_rms_norm` also does a MoE layer's combine on the way in.

Same arithmetic as deepserve/layers/norm.py: x + residual rounded to the activation dtype, statistics in float32,
the normalised value rounded to the activation dtype before the weight multiplies it, the product in the promoted
dtype of (weight, x). Only the order of the sum of squares differs from PyTorch's, so results agree to one
rounding of the output dtype.
"""

from typing import Optional

import torch

from deepserve.kernels import next_pow2, require_triton, tl, triton
from deepserve.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait
from deepserve.kernels.reference.moe import PairRows
from deepserve.kernels.reference.norm import add_rms_norm


@triton.jit
def rms_normed(x, w_ptr, cols, mask, n_cols, eps, OUT_FP32: tl.constexpr):
    """RMSNorm of one row x (masked lanes 0) with weight w: statistics in float32, the normalised value rounded to
    x's dtype before the weight multiplies it, the product in float32 (OUT_FP32: the promoted dtype of a float32
    weight) or else rounded to x's dtype. Shared with the MLA latent cache write (kernels/mla_decode.py)."""
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    out = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) * normed
    if not OUT_FP32:
        out = out.to(x.dtype)
    return out


@triton.jit
def _rms_norm_kernel(x_ptr, shared_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                     stride_x, stride_s, stride_r, stride_o, stride_ro,
                     n_cols, eps,
                     TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                     USE_PDL: tl.constexpr):
    """One row. TOP_K 0: x is row `row` of x_ptr. TOP_K k: x is a MoE layer's uncombined output (PairRows): rows
    row * k .. row * k + k - 1 of x_ptr added in slot order, then the shared row, in float32 and rounded once, as
    kernels/fused_moe.py's combine kernel writes it."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)    # constant: may load before the wait
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    if TOP_K == 0:
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    else:
        acc = tl.zeros([BLOCK], tl.float32)
        for j in tl.static_range(TOP_K):
            acc += tl.load(x_ptr + (row * TOP_K + j) * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SHARED:
            acc += tl.load(shared_ptr + row * stride_s + cols, mask=mask, other=0.0).to(tl.float32)
        x = acc.to(x_ptr.dtype.element_ty)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def fused_add_rms_norm(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float):
    """`rms_norm(x)`; with `residual`: `(rms_norm(x + residual), x + residual)`. x, residual: [..., hidden]."""
    require_triton(x)
    hidden = x.shape[-1]
    x2 = _rows(x, hidden)
    if residual is not None:
        assert residual.dtype == x.dtype and residual.shape == x.shape
    out, res_out = _launch(x2, None, 0, residual, weight, eps)
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))


def combine_add_rms_norm(pairs: PairRows, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """`fused_add_rms_norm(pairs.combined(), residual, weight, eps)` in one launch: a MoE layer's combine (its
    pair rows summed per token, the shared experts' rows added) done as the next norm loads its input, bit for bit
    what the combine kernel and the norm kernel give one after the other. residual: [T, hidden]."""
    require_triton(residual)
    pair_out, top_k, shared = pairs.pair_out, pairs.top_k, pairs.shared_out
    hidden = pair_out.shape[1]
    assert residual.shape == (pairs.num_tokens, hidden) and residual.dtype == pair_out.dtype, \
        f"residual {tuple(residual.shape)} {residual.dtype} for {pairs.num_tokens} tokens' {pair_out.dtype} pairs"
    if shared is not None:
        assert shared.shape == residual.shape and shared.dtype == pair_out.dtype
        shared = _rows(shared, hidden)
    return _launch(_rows(pair_out, hidden), shared, top_k, residual, weight, eps)


def _rows(x: torch.Tensor, hidden: int) -> torch.Tensor:
    """x as [rows, hidden] with unit column stride (rows may be strided)."""
    x2 = x.reshape(-1, hidden)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(x2, shared, top_k, residual, weight, eps):
    """(normed [rows, hidden], x + residual [rows, hidden] or None); rows = x2's rows / top_k (top_k 0: x2's)."""
    hidden = x2.shape[1]
    rows = x2.shape[0] // top_k if top_k else x2.shape[0]
    out_dtype = torch.promote_types(weight.dtype, x2.dtype)
    out = torch.empty(rows, hidden, dtype=out_dtype, device=x2.device)
    if residual is not None:
        r2 = _rows(residual, hidden)
        res_out = torch.empty(rows, hidden, dtype=x2.dtype, device=x2.device)
    else:
        r2, res_out = x2, out
    s2 = shared if shared is not None else x2          # a placeholder without HAS_SHARED
    if rows:
        block = next_pow2(hidden)
        num_warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
        _rms_norm_kernel[(rows,)](
            x2, s2, r2, weight, out, res_out, x2.stride(0), s2.stride(0), r2.stride(0), out.stride(0),
            res_out.stride(0), hidden, eps, TOP_K=top_k, HAS_SHARED=shared is not None,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps, **pdl_launch_args(x2))
    return out, (res_out if residual is not None else None)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float):
    """The PyTorch twin (what RMSNorm.forward computes off the GPU)."""
    return add_rms_norm(x, residual, weight, eps)


def combine_add_rms_norm_ref(pairs: PairRows, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """The PyTorch twin of combine_add_rms_norm."""
    return add_rms_norm(pairs.combined(), residual, weight, eps)


__all__ = ["combine_add_rms_norm", "combine_add_rms_norm_ref", "fused_add_rms_norm", "fused_add_rms_norm_ref"]
