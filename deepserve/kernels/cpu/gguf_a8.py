"""x @ W^T for GGUF Q4_1 / Q8_0 weights with int8 activations (quantization="gguf_a8"), in C (gguf_a8.c).

llama.cpp's numerics: x is quantized per 32-block (scale max|x| / 127, round half to even) and multiplied by the
blocks' integers in integer dot products (AVX-512 VNNI, AVX-VNNI, AVX2's maddubs, or plain C). The weights are the
file's, but repacked once at load (`repack`: per row the same bytes in another order, the layout in gguf_a8.c), so
two blocks go through one 512-bit instruction with no unpacking beyond an and / shift. Rows from MANY_ROWS on (a
longer prefill chunk) take dequantize + sgemm with fp32 activations, as quantization="gguf" does.

Without the C library the PyTorch references below run: `repack_ref` / `unpack_ref` for the layout, `linear_ref`
(the same quantization, then exact integer sums in float64) for the product.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from deepserve.kernels.cpu import build as _build
from deepserve.kernels.cpu import enabled, isa
from deepserve.kernels.cpu import gguf_linear as gk

_SOURCE = Path(__file__).with_name("gguf_a8.c")
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
QK, Q4_1, Q8_0 = gk.QK, gk.Q4_1, gk.Q8_0

ISAS = {"scalar": 0, "avx2": 1, "avx_vnni": 3, "avx512_vnni": 4}
# From this many rows on, dequantize + sgemm (fp32 activations). 48, not gguf_linear's 32: with the int8 kernel at
# 32-47 rows a 32- or 40-token prompt reached 312-360 against 216-279 tokens/s to its first token (best of four; AVX2
# EPYC, session 53, benchmarks/cpu_prefill_many_rows_ab_s53.json); at 48-63 rows the two were within that host's noise
# and an AVX-512 VNNI Xeon's sgemm won at 64 (gguf_a8_checks.json). Module-level so a measurement can move it: NLL of
# int8 activations everywhere, as llama.cpp computes a prompt (cpu_vs_llamacpp.py).
MANY_ROWS = 48
_ISA_NAMES = {v: k for k, v in ISAS.items()}
_AVX2_FLAGS = ("avx2", "fma", "f16c")
_AVX512_VNNI_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni") + _AVX2_FLAGS


@functools.lru_cache(maxsize=None)
def _load() -> ctypes.CDLL | None:
    lib = _build.load(_SOURCE, {
        "gguf_a8_repack": [_INT, _P, _I64, _I64, _P],
        "gguf_a8_dequantize": [_INT, _P, _I64, _I64, _P, _INT],
        "gguf_a8_quantize": [_INT, _P, _I64, _I64, _I64, _P],
        "gguf_a8_gemm": [_INT, _INT, _P, _I64, _I64, _P, _I64, _P, _I64, _INT],
        "gguf_a8_resolved_isa": [_INT, _P],
    })
    if lib is not None:
        lib.gguf_a8_linear.argtypes = [_INT, _INT, _P, _I64, _I64, _P, _I64, _I64, _P, _I64, _INT, _P]
        lib.gguf_a8_linear.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    return _load() if enabled() else None


def choose_isa(features: isa.CpuFeatures | None = None) -> str:
    """The integer dot-product code for a CPU with `features` (default: `isa.current()`, DEEPSERVE_CPU_ISA-aware)."""
    features = isa.current() if features is None else features
    if all(features.has(f) for f in _AVX512_VNNI_FLAGS):
        return "avx512_vnni"
    if all(features.has(f) for f in _AVX2_FLAGS):
        return "avx_vnni" if features.has("avx_vnni") else "avx2"
    return "scalar"


def resolved_isa(name: str) -> str:
    """The code the C library runs when asked for `name` (a level this CPU lacks drops to one it has)."""
    lib = library()
    if lib is None:
        return "torch"
    out = ctypes.c_int()
    lib.gguf_a8_resolved_isa(ISAS[name], ctypes.byref(out))
    return _ISA_NAMES[out.value]


# ---------------------------------------------------------------- the weights' layout

def _positions(nb: int, odd_last_in_order: bool = True) -> torch.Tensor:
    """pos [nb * 32]: where element j of block b (index 32 b + j) sits in a row's pair-ordered bytes (gguf_a8.c's
    pair_offset); an odd last block keeps element order in a weight row, pair order (zero partner) in an x row."""
    b = torch.arange(nb).repeat_interleave(QK)
    j = torch.arange(QK).repeat(nb)
    pos = 64 * (b // 2) + torch.where(j < 16, 0, 32) + 16 * (b % 2) + j % 16
    if nb % 2 and odd_last_in_order:
        last = b == nb - 1
        pos[last] = 32 * (nb - 1) + j[last]
    return pos


def repack_ref(blocks: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """The file's blocks uint8 [N, row_bytes] -> the same rows in gguf_a8.c's layout (PyTorch)."""
    gk.check_blocks(blocks, qtype, in_features)
    n, nb = blocks.shape[0], in_features // QK
    b = blocks.reshape(n, nb, gk.BLOCK_BYTES[qtype])
    if qtype == Q4_1:
        return torch.cat([b[..., 4:].reshape(n, -1), b[..., 0:2].reshape(n, -1), b[..., 2:4].reshape(n, -1)], 1)
    qs = torch.empty(n, nb * QK, dtype=torch.uint8)
    qs[:, _positions(nb)] = b[..., 2:].reshape(n, nb * QK)
    return torch.cat([qs, b[..., 0:2].reshape(n, -1)], dim=1).contiguous()


def unpack_ref(repacked: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """gguf_a8.c's layout -> the file's blocks (the inverse of repack_ref)."""
    n, nb = repacked.shape[0], in_features // QK
    if qtype == Q4_1:
        qs, d, m = repacked.split([16 * nb, 2 * nb, 2 * nb], dim=1)
        parts = [d.reshape(n, nb, 2), m.reshape(n, nb, 2), qs.reshape(n, nb, 16)]
    else:
        qs, d = repacked.split([32 * nb, 2 * nb], dim=1)
        parts = [d.reshape(n, nb, 2), qs[:, _positions(nb)].reshape(n, nb, QK)]
    return torch.cat(parts, dim=2).reshape(n, -1).contiguous()


def repack(blocks: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """The file's blocks -> gguf_a8.c's layout (in C where it is built): what GGUFLinear keeps in gguf_a8 mode."""
    gk.check_blocks(blocks, qtype, in_features)
    lib = library()
    if lib is None or not blocks.is_cpu:
        return repack_ref(blocks, qtype, in_features)
    blocks = blocks.contiguous()
    out = torch.empty_like(blocks)
    lib.gguf_a8_repack(qtype, blocks.data_ptr(), blocks.shape[0], in_features, out.data_ptr())
    return out


def dequantize(repacked: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """A repacked W as float32 [N, in_features], bit for bit gguf_linear.dequantize_ref of the file's blocks."""
    lib = library()
    if lib is None or not repacked.is_contiguous() or not repacked.is_cpu:
        return gk.dequantize_ref(unpack_ref(repacked, qtype, in_features), qtype, in_features)
    out = torch.empty(repacked.shape[0], in_features, dtype=torch.float32)
    lib.gguf_a8_dequantize(qtype, repacked.data_ptr(), repacked.shape[0], in_features, out.data_ptr(),
                           torch.get_num_threads())
    return out


# ---------------------------------------------------------------- activations and the product

def quantize_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K] in element order, scale [M, K/32], scale * block sum [M, K/32])."""
    blocks = x.float().reshape(x.shape[0], -1, QK)
    d = blocks.abs().amax(dim=-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None]).to(torch.int8)                          # half to even
    return q.reshape(x.shape), d, d * q.sum(dim=-1, dtype=torch.int32).float()


def quantized_row_bytes(in_features: int) -> int:
    nb = in_features // QK
    return 64 * ((nb + 1) // 2) + 8 * ((nb + 15) // 16 * 16)


def quantize(x: torch.Tensor, isa_name: str | None = None) -> torch.Tensor:
    """x [M, K] fp32 -> the C kernel's quantized rows, uint8 [M, quantized_row_bytes(K)] (for tests)."""
    lib = library()
    assert lib is not None, "quantize() reads the C layout: it needs the library"
    x = x.contiguous().float()
    out = torch.empty(x.shape[0], quantized_row_bytes(x.shape[1]), dtype=torch.uint8)
    lib.gguf_a8_quantize(ISAS[isa_name or choose_isa()], x.data_ptr(), x.shape[0], x.shape[1], x.shape[1],
                         out.data_ptr())
    return out


def split_quantized(rows: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize`'s rows -> (int8 [M, K] in element order, scale [M, K/32], scale * sum [M, K/32]), as quantize_ref."""
    nb = in_features // QK
    nbp, nbs = (nb + 1) // 2 * 2, (nb + 15) // 16 * 16
    xq = rows[:, :32 * nbp].contiguous().view(torch.int8)
    scales = rows[:, 32 * nbp:].contiguous().view(torch.float32)
    return xq[:, _positions(nb, odd_last_in_order=False)], scales[:, :nb], scales[:, nbs:nbs + nb]


def linear_ref(x: torch.Tensor, blocks: torch.Tensor, qtype: int, in_features: int) -> torch.Tensor:
    """The product the kernels compute, for the file's blocks: quantize_ref's x, exact integer block sums, the
    scales applied in float64 (so the kernels differ from it only by their fp32 rounding)."""
    q, d, s = quantize_ref(x)
    n, nb = blocks.shape[0], in_features // QK
    b = blocks.reshape(n, nb, gk.BLOCK_BYTES[qtype])
    dw = b[..., 0:2].contiguous().view(torch.float16).float()[..., 0]                 # [N, nb]
    if qtype == Q4_1:
        qs = b[..., 4:]
        qw = torch.cat([qs & 15, qs >> 4], dim=-1).double()
    else:
        qw = b[..., 2:].contiguous().view(torch.int8).double()
    isum = torch.einsum("mbj,nbj->mnb", q.reshape(-1, nb, QK).double(), qw)           # exact integers
    y = (isum * (dw[None] * d[:, None]).double()).sum(-1)
    if qtype == Q4_1:
        m = b[..., 2:4].contiguous().view(torch.float16).float()[..., 0]
        y = y + (s.double() @ m.double().T)
    return y.float()


def linear(x: torch.Tensor, repacked: torch.Tensor, qtype: int, in_features: int, isa_name: str | None = None,
           many_rows: int | None = None) -> torch.Tensor:
    """x [M, in_features] fp32 @ W^T -> [M, N] fp32, W repacked (`repack`). Fewer than `many_rows` rows (default
    MANY_ROWS): int8 activations in C with `isa_name`'s code (default `choose_isa()`); more: dequantize + sgemm."""
    if x.shape[0] >= (MANY_ROWS if many_rows is None else many_rows):
        return F.linear(x.float(), dequantize(repacked, qtype, in_features))
    lib = library()
    if lib is None or x.dtype != torch.float32 or x.dim() != 2 or not x.is_cpu or not repacked.is_contiguous():
        return linear_ref(x, unpack_ref(repacked, qtype, in_features), qtype, in_features)
    x = x.contiguous()
    m, n = x.shape[0], repacked.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    err = lib.gguf_a8_linear(qtype, ISAS[isa_name or choose_isa()], repacked.data_ptr(), n, in_features,
                             x.data_ptr(), m, in_features, y.data_ptr(), n, torch.get_num_threads(), None)
    if err:
        raise MemoryError("gguf_a8_linear: could not allocate the quantized activations")
    return y


class PackedGemmA8(gk.PackedGemm):
    """`linear` for one layer's type and K with the library and the vector code looked up once (at load), as
    gguf_linear.PackedGemm; anything but few contiguous fp32 CPU rows falls back to `linear`."""

    def _kernel(self) -> tuple:
        lib = library()
        return (None if lib is None else lib.gguf_a8_linear), ISAS[choose_isa()]

    def _many_rows(self) -> int:
        return MANY_ROWS

    def _general(self, x: torch.Tensor, repacked: torch.Tensor) -> torch.Tensor:
        return linear(x, repacked, self.qtype, self.in_features)

    def _launch(self, x: torch.Tensor, repacked: torch.Tensor, y: torch.Tensor) -> None:
        n = repacked.shape[0]
        if self._fn(self.qtype, self._isa, repacked.data_ptr(), n, self.in_features, x.data_ptr(), x.shape[0],
                    self.in_features, y.data_ptr(), n, torch.get_num_threads(), None):
            raise MemoryError("gguf_a8_linear: could not allocate the quantized activations")


__all__ = ["ISAS", "MANY_ROWS", "PackedGemmA8", "choose_isa", "dequantize", "library", "linear", "linear_ref",
           "quantize", "quantize_ref", "quantized_row_bytes", "repack", "repack_ref", "resolved_isa",
           "split_quantized", "unpack_ref"]
