"""RMSNorm (with the residual add), NeoX rotary and SiLU-and-mul for float32 CPU tensors, in C (elementwise.c).

Each function returns None when the C library is missing or disabled or the tensors do not fit what it takes
(dtype, layout); the caller then runs its PyTorch reference (layers/norm.py, layers/rotary.py, layers/mlp.py),
which the tests compare these against.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from deepserve.kernels.cpu import build as _build
from deepserve.kernels.cpu import enabled

_SOURCE = Path(__file__).with_name("elementwise.c")
_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


@functools.lru_cache(maxsize=None)
def _load() -> ctypes.CDLL | None:
    return _build.load(_SOURCE, {
        "rms_norm_rows": [_P, _I64, _P, _I64, _P, _P, _I64, _P, _I64, _I64, _I64, _F, _INT],
        "rotate_half_rows": [_P, _I64, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _INT],
        "silu_mul_rows": [_P, _I64, _P, _I64, _I64, _INT]})


def _library() -> ctypes.CDLL | None:
    return _load() if enabled() else None


def _f32_cpu(*tensors: torch.Tensor) -> bool:
    # Autograd cannot see through C: with gradients on, only tensors that need none.
    grad = torch.is_grad_enabled()
    return all(t.dtype == torch.float32 and t.is_cpu and not (grad and t.requires_grad) for t in tensors)


def _rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as [rows, cols] without a copy (unit stride along cols), or None."""
    if x.dim() == 0 or x.stride(-1) != 1:
        return None
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:      # rows not evenly strided: the caller's PyTorch path
        return None


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """norm(x) or, with `residual`, (norm(x + residual), x + residual); None when the C path does not apply."""
    lib = _library()
    if lib is None or not _f32_cpu(x, weight) or not weight.is_contiguous() or weight.shape != x.shape[-1:]:
        return None
    x2 = _rows(x)
    if x2 is None:
        return None
    r2 = None
    if residual is not None:
        if not _f32_cpu(residual) or residual.shape != x.shape:
            return None
        r2 = _rows(residual)
        if r2 is None:
            return None
    rows, cols = x2.shape
    out = torch.empty(x.shape, dtype=torch.float32)
    res_out = torch.empty(x.shape, dtype=torch.float32) if r2 is not None else None
    lib.rms_norm_rows(x2.data_ptr(), x2.stride(0), r2.data_ptr() if r2 is not None else None,
                      r2.stride(0) if r2 is not None else 0, weight.data_ptr(), out.data_ptr(), cols,
                      res_out.data_ptr() if res_out is not None else None, cols, rows, cols, eps,
                      torch.get_num_threads())
    return out if res_out is None else (out, res_out)


def rotate_half(positions: torch.Tensor, x: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor):
    """x [T, heads, D] (any row/head strides, unit stride along D) rotated at `positions` [T] -> a new contiguous
    tensor; None when the C path does not apply."""
    lib = _library()
    if (lib is None or x.dim() != 3 or not _f32_cpu(x, cos_cache, sin_cache) or x.stride(2) != 1
            or positions.dtype != torch.int64 or not positions.is_cpu or not positions.is_contiguous()
            or cos_cache.stride() != sin_cache.stride() or cos_cache.stride(1) != 1 or x.shape[2] % 2
            or cos_cache.shape[1] != x.shape[2] or positions.shape != x.shape[:1]):
        return None
    t, heads, dim = x.shape
    if t and not 0 <= int(positions.min()) <= int(positions.max()) < cos_cache.shape[0]:
        raise IndexError(f"position outside the rotary cache [0, {cos_cache.shape[0]})")
    out = torch.empty(t, heads, dim, dtype=torch.float32)
    lib.rotate_half_rows(x.data_ptr(), x.stride(0), x.stride(1), positions.data_ptr(), cos_cache.data_ptr(),
                         sin_cache.data_ptr(), cos_cache.stride(0), out.data_ptr(), t, heads, dim,
                         torch.get_num_threads())
    return out


def silu_and_mul(gate_up: torch.Tensor):
    """[.., 2I] (gate then up) -> silu(gate) * up [.., I]; None when the C path does not apply."""
    lib = _library()
    if lib is None or not _f32_cpu(gate_up) or gate_up.shape[-1] % 2:
        return None
    x2 = _rows(gate_up)
    if x2 is None:
        return None
    rows, cols = x2.shape
    out = torch.empty(*gate_up.shape[:-1], cols // 2, dtype=torch.float32)
    lib.silu_mul_rows(x2.data_ptr(), x2.stride(0), out.data_ptr(), rows, cols // 2, torch.get_num_threads())
    return out


__all__ = ["rms_norm", "rotate_half", "silu_and_mul"]
