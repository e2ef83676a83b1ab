"""x @ W^T with W kept as GGUF's packed blocks (Q4_1, Q8_0), in C (gguf_linear.c), and the rows of such a W as fp32.

Activations stay fp32 (issue 21's numeric option (a)): the kernel widens each block's integers to float, so results
are x @ dequantize(W)^T up to the order of the sums. Which vector code runs is chosen here from the CPU's flags
(`isa.current()`, so DEEPSERVE_CPU_ISA=avx2 forces the AVX2 code on an AVX-512 host) and checked again in C:
"avx512" (F + BW + VL), "avx2" (AVX2 + FMA + F16C), "scalar" (plain C). Many rows are bound by arithmetic, not by
reading the weight: from `MANY_ROWS` rows on, the weight is dequantized (in C) and multiplied by torch's sgemm.

Without the C library (no compiler, DEEPSERVE_CPU_KERNELS=0) the PyTorch references below run instead: the same
dequantization (bit for bit the gguf package's) followed by F.linear. Int8 activations (llama.cpp's numerics,
quantization="gguf_a8") are gguf_a8.py's, over blocks repacked for them.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from deepserve.kernels.cpu import build as _build
from deepserve.kernels.cpu import enabled, isa

_SOURCE = Path(__file__).with_name("gguf_linear.c")
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int

# ggml's type ids -> (name, bytes per block of 32 weights).
Q4_0, Q4_1, Q8_0 = 2, 3, 8
BLOCK_BYTES = {Q4_1: 20, Q8_0: 34}        # the packed types the C kernels multiply by
DEQUANT_BLOCK_BYTES = {Q4_0: 18, **BLOCK_BYTES}   # dequantize_ref also reads Q4_0 (the GGUF loader's)
TYPE_NAMES = {Q4_1: "Q4_1", Q8_0: "Q8_0"}
QK = 32                                   # weights per block

ISAS = {"scalar": 0, "avx2": 1, "avx512": 2}
_ISA_NAMES = {v: k for k, v in ISAS.items()}
_AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c")
_AVX2_FLAGS = ("avx2", "fma", "f16c")

# From this many activation rows on: dequantize + sgemm. A 3072 x 576 Q4_1 GEMM on a 2-core AVX-512 Xeon, packed vs
# dequantize + sgemm: 16 rows 0.48 vs 0.81 ms, 32 rows 1.05 vs 0.96 ms (benchmarks/cpu_vs_llamacpp.json, "kernel_rows").
MANY_ROWS = 32


@functools.lru_cache(maxsize=None)
def _load() -> ctypes.CDLL | None:
    return _build.load(_SOURCE, {
        "gguf_linear": [_INT, _INT, _P, _I64, _I64, _P, _I64, _I64, _P, _I64, _INT],
        "gguf_dequantize_rows": [_INT, _P, _I64, _P, _I64, _P, _INT],
        "gguf_resolved_isa": [_INT, _P],
    })


def library() -> ctypes.CDLL | None:
    return _load() if enabled() else None


def choose_isa(features: isa.CpuFeatures | None = None) -> str:
    """The vector code for a CPU with `features` (default: `isa.current()`)."""
    features = isa.current() if features is None else features
    if all(features.has(f) for f in _AVX512_FLAGS):
        return "avx512"
    if all(features.has(f) for f in _AVX2_FLAGS):
        return "avx2"
    return "scalar"


def resolved_isa(name: str) -> str:
    """The code the C library runs when asked for `name` (a level this CPU lacks drops to one it has)."""
    lib = library()
    if lib is None:
        return "torch"
    out = ctypes.c_int()
    lib.gguf_resolved_isa(ISAS[name], ctypes.byref(out))
    return _ISA_NAMES[out.value]


def supported(qtype: int) -> bool:
    return qtype in BLOCK_BYTES


def check_blocks(blocks: torch.Tensor, qtype: int, in_features: int) -> None:
    if not supported(qtype):
        raise ValueError(f"GGUF type {qtype} is not packed here (supported: {sorted(TYPE_NAMES.values())})")
    if in_features % QK:
        raise ValueError(f"in_features {in_features} is not a multiple of {QK}")
    row_bytes = in_features // QK * BLOCK_BYTES[qtype]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes:
        raise ValueError(f"blocks must be uint8 [rows, {row_bytes}] for {TYPE_NAMES[qtype]} with K={in_features}; "
                         f"got {blocks.dtype} {tuple(blocks.shape)}")


def dequantize_ref(blocks: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """blocks uint8 [N, row_bytes] -> float32 [N, in_features], as the gguf package computes it (d * q + m)."""
    n = blocks.shape[0]
    b = blocks.reshape(n, in_features // QK, DEQUANT_BLOCK_BYTES[qtype])
    d = b[..., 0:2].contiguous().view(torch.float16).float()                       # [N, nb, 1]
    if qtype == Q4_0:
        qs = b[..., 2:]
        return (d * (torch.cat([qs & 15, qs >> 4], dim=-1).to(torch.int8) - 8).float()).reshape(n, in_features)
    if qtype == Q4_1:
        m = b[..., 2:4].contiguous().view(torch.float16).float()
        qs = b[..., 4:]
        q = torch.cat([qs & 15, qs >> 4], dim=-1).float()                          # [N, nb, 32]
        return (d * q + m).reshape(n, in_features)
    q = b[..., 2:].contiguous().view(torch.int8).float()
    return (q * d).reshape(n, in_features)


def dequantize(blocks: torch.Tensor, qtype: int, in_features: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `rows` (int64 indices; None: all) of W as float32 [len(rows), in_features], bit for bit dequantize_ref."""
    lib = library()
    if lib is None or not blocks.is_contiguous() or not blocks.is_cpu:
        w = blocks if rows is None else blocks[rows]
        return dequantize_ref(w, qtype, in_features)
    if rows is None:
        n, ptr = blocks.shape[0], None
    else:
        rows = rows.reshape(-1).to(torch.int64).contiguous()
        n, ptr = rows.numel(), rows.data_ptr()
        if n and (int(rows.min()) < 0 or int(rows.max()) >= blocks.shape[0]):
            raise IndexError(f"row index out of range for {blocks.shape[0]} rows")
    out = torch.empty(n, in_features, dtype=torch.float32)
    lib.gguf_dequantize_rows(qtype, blocks.data_ptr(), in_features, ptr, n, out.data_ptr(), torch.get_num_threads())
    return out


def gguf_linear_ref(x: torch.Tensor, blocks: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    return F.linear(x.float(), dequantize_ref(blocks, qtype, in_features))


def gguf_linear(x: torch.Tensor, blocks: torch.Tensor, qtype: int, in_features: int,
                isa_name: str | None = None, many_rows: int | None = None) -> torch.Tensor:
    """x [M, in_features] float32 @ W^T -> [M, N] float32, W given as its blocks (uint8 [N, row_bytes]).

    Fewer than `many_rows` (default MANY_ROWS) rows: the packed kernel with `isa_name`'s code (default
    `choose_isa()`); more: dequantize + sgemm. Tensors the kernel cannot take (another dtype, strided rows, no library) take the reference path."""
    lib = library()
    m = x.shape[0]
    if lib is None or x.dtype != torch.float32 or x.dim() != 2 or not x.is_cpu or not blocks.is_contiguous() \
            or x.shape[1] != in_features:
        return gguf_linear_ref(x, blocks, qtype, in_features)
    if m >= (MANY_ROWS if many_rows is None else many_rows):
        return F.linear(x, dequantize(blocks, qtype, in_features))
    if x.stride(1) != 1:
        x = x.contiguous()
    n = blocks.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    lib.gguf_linear(qtype, ISAS[isa_name or _default_isa()], blocks.data_ptr(), n, in_features, x.data_ptr(), m,
                    x.stride(0), y.data_ptr(), n, torch.get_num_threads())
    return y


class PackedGemm:
    """`gguf_linear` for one layer's type and K, with the library, its function and the vector code looked up once
    (at load): a decode step makes ~120 of these calls, where the general entry point's checks cost ~10 us each.
    Takes the same inputs as `gguf_linear` and falls back to it for anything but few contiguous fp32 CPU rows."""

    def __init__(self, qtype: int, in_features: int) -> None:
        self.qtype, self.in_features = qtype, in_features
        self._fn, self._isa = self._kernel()

    def _kernel(self) -> tuple:
        """(the C function or None, its vector-code argument)."""
        lib = library()
        return (None if lib is None else lib.gguf_linear), ISAS[_default_isa()]

    def _many_rows(self) -> int:
        return MANY_ROWS

    def _general(self, x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        return gguf_linear(x, blocks, self.qtype, self.in_features)

    def _launch(self, x: torch.Tensor, blocks: torch.Tensor, y: torch.Tensor) -> None:
        n = blocks.shape[0]
        self._fn(self.qtype, self._isa, blocks.data_ptr(), n, self.in_features, x.data_ptr(), x.shape[0],
                 self.in_features, y.data_ptr(), n, torch.get_num_threads())

    def __call__(self, x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if self._fn is None or m >= self._many_rows() or x.dtype is not torch.float32 or not x.is_contiguous() \
                or x.dim() != 2 or x.shape[1] != self.in_features or not x.is_cpu or not blocks.is_contiguous():
            return self._general(x, blocks)
        y = torch.empty(m, blocks.shape[0], dtype=torch.float32)
        self._launch(x, blocks, y)
        return y


@functools.lru_cache(maxsize=None)
def _cached_isa(name: str) -> str:
    return choose_isa()


def _default_isa() -> str:
    from deepserve import envs
    return _cached_isa(envs.DEEPSERVE_CPU_ISA)


__all__ = ["BLOCK_BYTES", "DEQUANT_BLOCK_BYTES", "ISAS", "MANY_ROWS", "PackedGemm", "Q4_0", "Q4_1", "Q8_0", "QK",
           "TYPE_NAMES", "check_blocks", "choose_isa", "dequantize", "dequantize_ref", "gguf_linear",
           "gguf_linear_ref", "library", "resolved_isa", "supported"]
