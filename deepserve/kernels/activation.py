"""SiLU-and-mul: out = silu(gate) * up over the two halves of the gate_up projection, in one pass.

Same arithmetic as `F.silu(gate) * up` in PyTorch: silu in float32 (x / (1 + exp(-x)), CUDA's accurate expf
through libdevice and an IEEE division) rounded to the activation dtype, then the product rounded again; results
agree with PyTorch to one rounding of the output dtype.
"""

import torch
import torch.nn.functional as F

from deepserve.kernels import USE_LIBDEVICE, libdevice, require_triton, tl, triton


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr, ACCURATE_EXP: tl.constexpr):
    """silu(gate) * up as PyTorch computes it on `dtype` tensors (gate, up: float32 holding dtype values): silu in
    float32 rounded to dtype, then the product rounded again. Shared with the batch-1 gate/up GEMV (kernels/gemv.py),
    so that its fused SwiGLU gives the same bits as this kernel after the GEMM."""
    if ACCURATE_EXP:
        e = libdevice.exp(-gate)
    else:
        e = tl.exp(-gate)
    silu = tl.math.div_rn(gate, 1.0 + e).to(dtype).to(tl.float32)
    return (silu * up).to(dtype)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols,
                         BLOCK: tl.constexpr, ACCURATE_EXP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, silu_mul(gate, up, out_ptr.dtype.element_ty, ACCURATE_EXP), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * I] -> [..., I] = silu(x[..., :I]) * x[..., I:]."""
    require_triton(x)
    two_i = x.shape[-1]
    assert two_i % 2 == 0
    inter = two_i // 2
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(rows, inter, dtype=x.dtype, device=x.device)
    if rows and inter:
        block = 1024
        _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](
            x2, out, x2.stride(0), out.stride(0), inter, BLOCK=block, ACCURATE_EXP=USE_LIBDEVICE, num_warps=4)
    return out.view(*x.shape[:-1], inter)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """The PyTorch twin (what the Llama MLP computes on gate_up_proj's output)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


__all__ = ["silu_and_mul", "silu_and_mul_ref"]
