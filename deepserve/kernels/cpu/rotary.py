"""NeoX rotary embedding for float32 CPU tensors, in C (rotary.c).

`rotate_half` returns None when the C library is missing or disabled or the tensors do not fit what it takes
(dtype, layout); the caller (layers/rotary.py) then runs its PyTorch reference, which the tests compare it to.
(RMSNorm and SiLU-and-mul in C were measured too and dropped: at 1 row the ctypes call costs what PyTorch's few
ops do, at 64 rows PyTorch's vectorized kernels were faster than plain C loops.)
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from deepserve.kernels.cpu import build as _build
from deepserve.kernels.cpu import enabled

_SOURCE = Path(__file__).with_name("rotary.c")
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@functools.lru_cache(maxsize=None)
def _load() -> ctypes.CDLL | None:
    return _build.load(_SOURCE, {"rotate_half_rows": [_P, _I64, _I64, _P, _P, _P, _I64, _P, _I64, _I64, _I64, _INT]})


def _library() -> ctypes.CDLL | None:
    return _load() if enabled() else None


def _f32_cpu(*tensors: torch.Tensor) -> bool:
    # Autograd cannot see through C: with gradients on, only tensors that need none.
    grad = torch.is_grad_enabled()
    return all(t.dtype == torch.float32 and t.is_cpu and not (grad and t.requires_grad) for t in tensors)


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
    _check_positions(positions, cos_cache.shape[0])
    out = torch.empty(t, heads, dim, dtype=torch.float32)
    lib.rotate_half_rows(x.data_ptr(), x.stride(0), x.stride(1), positions.data_ptr(), cos_cache.data_ptr(),
                         sin_cache.data_ptr(), cos_cache.stride(0), out.data_ptr(), t, heads, dim,
                         torch.get_num_threads())
    return out


_checked: list = [None, -1, -1]      # the positions tensor last found in bounds, its version, the bound


def _version(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version     # inference tensors keep no version counter


def _check_positions(positions: torch.Tensor, limit: int) -> None:
    """The C code indexes the cos/sin cache with these: out-of-range positions must raise, not read memory.
    Every layer of a step rotates at the same positions tensor, so it is checked once per tensor, not once per
    layer (an in-place write shows in the version counter; inference tensors, which the engine builds once per
    step and never writes, have none)."""
    if positions is _checked[0] and _version(positions) == _checked[1] and limit == _checked[2]:
        return
    if positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < limit:
        raise IndexError(f"position outside the rotary cache [0, {limit})")
    _checked[:] = [positions, _version(positions), limit]


__all__ = ["rotate_half"]
