"""Per-token int8 quantization of activations and the dequantizing epilogue of w8a8 GEMMs, in C (int8_quant.c),
each bit for bit the PyTorch version it falls back to. Used by layers/quantization.py on the CPU."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from deepserve.kernels.cpu import build as _build
from deepserve.kernels.cpu import enabled

_SOURCE = Path(__file__).with_name("int8_quant.c")
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@functools.lru_cache(maxsize=None)
def _load() -> ctypes.CDLL | None:
    return _build.load(_SOURCE, {"quantize_rows": [_P, _I64, _I64, _P, _P, _INT],
                                 "dequantize_rows": [_P, _I64, _I64, _P, _P, _P, _INT]})


def _library() -> ctypes.CDLL | None:
    return _load() if enabled() else None


def quantize_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] float32 -> (int8 [rows, cols], scales [rows, 1] float32)."""
    scales = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
    return torch.round(x / scales).to(torch.int8), scales


def dequantize_ref(acc: torch.Tensor, row_scales: torch.Tensor, col_scales: torch.Tensor) -> torch.Tensor:
    """acc [rows, cols] int32 -> float32 acc * row_scales [rows, 1] * col_scales [cols]."""
    return acc.float().mul_(row_scales).mul_(col_scales)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, cols] float32 -> (int8 [rows, cols], scales [rows, 1] float32)."""
    lib = _library()
    if lib is None or x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or not x.is_cpu:
        return quantize_per_token_ref(x)
    rows, cols = x.shape
    q = torch.empty(rows, cols, dtype=torch.int8)
    scales = torch.empty(rows, 1, dtype=torch.float32)
    lib.quantize_rows(x.data_ptr(), rows, cols, q.data_ptr(), scales.data_ptr(), torch.get_num_threads())
    return q, scales


def dequantize(acc: torch.Tensor, row_scales: torch.Tensor, col_scales: torch.Tensor) -> torch.Tensor:
    lib = _library()
    ok = (lib is not None and acc.dtype == torch.int32 and acc.is_contiguous() and acc.dim() == 2
          and row_scales.dtype == col_scales.dtype == torch.float32 and row_scales.is_contiguous()
          and col_scales.is_contiguous() and row_scales.numel() == acc.shape[0] and col_scales.numel() == acc.shape[1])
    if not ok:
        return dequantize_ref(acc, row_scales, col_scales)
    rows, cols = acc.shape
    out = torch.empty(rows, cols, dtype=torch.float32)
    lib.dequantize_rows(acc.data_ptr(), rows, cols, row_scales.data_ptr(), col_scales.data_ptr(), out.data_ptr(),
                        torch.get_num_threads())
    return out


__all__ = ["quantize_per_token", "quantize_per_token_ref", "dequantize", "dequantize_ref"]
