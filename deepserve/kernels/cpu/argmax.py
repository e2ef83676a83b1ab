"""Row-wise argmax of float32 CPU logits in C (argmax.c): the greedy sampler's pick, ~10x faster than torch's
CPU argmax at batch 64 x 49k. `argmax_rows` returns None when the C library is missing or disabled or the tensor
does not fit (the caller then runs torch.argmax, which the tests compare it to)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from deepserve.kernels.cpu import build as _build
from deepserve.kernels.cpu import enabled

_SOURCE = Path(__file__).with_name("argmax.c")
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@functools.lru_cache(maxsize=None)
def _load() -> ctypes.CDLL | None:
    return _build.load(_SOURCE, {"argmax_rows": [_P, _I64, _I64, _I64, _P, _INT]})


def _library() -> ctypes.CDLL | None:
    return _load() if enabled() else None


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x [rows, cols] float32 (unit stride along cols) -> [rows] int64, the first index of each row's maximum."""
    lib = _library()
    if lib is None or x.dtype != torch.float32 or not x.is_cpu or x.dim() != 2 or x.stride(1) != 1 or x.shape[1] == 0:
        return None
    rows, cols = x.shape
    out = torch.empty(rows, dtype=torch.int64)
    lib.argmax_rows(x.data_ptr(), rows, cols, x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


__all__ = ["argmax_rows"]
