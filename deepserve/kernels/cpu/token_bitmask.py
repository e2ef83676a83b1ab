"""Structured outputs' token bitmask applied to float32 CPU logits in place, in C (token_bitmask.c).
`apply_token_bitmask_` returns False when the C library is missing or disabled or the tensors do not fit (the
caller then unpacks the bits with torch ops, which the tests compare it to)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from deepserve.kernels.cpu import build as _build
from deepserve.kernels.cpu import enabled

_SOURCE = Path(__file__).with_name("token_bitmask.c")
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@functools.cache
def _load() -> ctypes.CDLL | None:
    return _build.load(_SOURCE, {"apply_token_bitmask": [_P, _I64, _P, _I64, _P, _I64, _I64, _INT]})


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> bool:
    """logits [B, V] float32 (unit stride along V), bitmask [B, W] int32 contiguous, W * 32 >= V; rows [G] int64:
    sets logits[r, t] = -inf where bit t of bitmask[r] is clear, for each r in rows. False: nothing done."""
    lib = _load() if enabled() else None
    if (lib is None or logits.dtype != torch.float32 or not logits.is_cpu or logits.dim() != 2
            or logits.stride(1) != 1 or bitmask.dtype != torch.int32 or not bitmask.is_contiguous()
            or bitmask.shape[0] != logits.shape[0] or bitmask.shape[1] * 32 < logits.shape[1]):
        return False
    rows = rows.to(dtype=torch.int64, device="cpu").contiguous()
    lib.apply_token_bitmask(logits.data_ptr(), logits.stride(0), bitmask.data_ptr(), bitmask.shape[1],
                            rows.data_ptr(), rows.numel(), logits.shape[1], torch.get_num_threads())
    return True


__all__ = ["apply_token_bitmask_"]
