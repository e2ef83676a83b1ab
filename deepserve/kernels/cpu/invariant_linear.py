"""The batch-invariant linear layer in C (invariant_linear.c): y = x @ w.T (+ bias), float32, each output element
summed in one order that depends only on K, never on the number of rows, a row's place among them or the thread
count. `invariant_linear` returns None when the C library is missing or disabled or the tensors do not fit (the
caller then takes `layers/batch_invariant.py`'s fixed-tile path)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from deepserve.kernels.cpu import build as _build
from deepserve.kernels.cpu import enabled, isa

_SOURCE = Path(__file__).with_name("invariant_linear.c")
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
K_MULTIPLE = 16     # the kernel's widest vector: K must be a multiple of it
SIGNATURE = {"invariant_linear": [_P, _I64, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _INT]}
_DEFINES: tuple[str, ...] = ()   # e.g. ("LINEAR_LANES=8",): a width other than this CPU's (tests build both)


@functools.lru_cache(maxsize=None)
def _load() -> ctypes.CDLL | None:
    return _build.load(_SOURCE, SIGNATURE, defines=isa.vector_width_defines() + _DEFINES)


def _library() -> ctypes.CDLL | None:
    return _load() if enabled() else None


def fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """x [M, K], weight [N, K], bias [N] or None: float32 CPU tensors, unit stride along K, K a multiple of 16."""
    tensors = [x, weight] + ([bias] if bias is not None else [])
    return (all(t.dtype == torch.float32 and t.is_cpu and t.stride(-1) == 1 for t in tensors)
            and x.dim() == 2 and weight.dim() == 2 and x.shape[1] == weight.shape[1]
            and x.shape[1] % K_MULTIPLE == 0 and (bias is None or bias.shape == (weight.shape[0],)))


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [M, K] -> [M, N], or None when the kernel is unavailable or the tensors do not fit (`fits`)."""
    lib = _library()
    if lib is None or not fits(x, weight, bias):
        return None
    (m, k), n = x.shape, weight.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    if m:
        lib.invariant_linear(x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0),
                             bias.data_ptr() if bias is not None else None, out.data_ptr(), n, m, n, k,
                             torch.get_num_threads())
    return out


__all__ = ["K_MULTIPLE", "fits", "invariant_linear"]
