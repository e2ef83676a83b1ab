"""RMSNorm, optionally fused with the residual add before it: one read of x (and residual), one write of the
normalised output (and of x + residual).

Same arithmetic as deepserve/layers/norm.py: x + residual rounded to the activation dtype, statistics in float32,
the normalised value rounded to the activation dtype before the weight multiplies it, the product in the promoted
dtype of (weight, x). Only the order of the sum of squares differs from PyTorch's, so results agree to one
rounding of the output dtype.
"""

from typing import Optional

import torch

from deepserve.kernels import next_pow2, require_triton, tl, triton
from deepserve.kernels.pdl import pdl_launch_args, pdl_launch_dependents, pdl_wait
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
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
                     stride_x, stride_r, stride_o, stride_ro,
                     n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)    # constant: may load before the wait
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
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
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(rows, hidden, dtype=out_dtype, device=x.device)
    if residual is not None:
        assert residual.dtype == x.dtype and residual.shape == x.shape
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        res_out = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    else:
        r2, res_out = x2, out
    if rows:
        block = next_pow2(hidden)
        num_warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
        _rms_norm_kernel[(rows,)](
            x2, r2, weight, out, res_out, x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0),
            hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps,
            **pdl_launch_args(x2))
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))


def fused_add_rms_norm_ref(x: torch.Tensor, residual: Optional[torch.Tensor], weight: torch.Tensor, eps: float):
    """The PyTorch twin (what RMSNorm.forward computes off the GPU)."""
    return add_rms_norm(x, residual, weight, eps)


__all__ = ["fused_add_rms_norm", "fused_add_rms_norm_ref"]
