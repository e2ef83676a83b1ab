"""C kernels for the CPU path, called through ctypes.

Plain C, no torch headers: compiled on first use with the system compiler (build.py) in about a second,
then cached. Without a compiler, when the build fails, or with DEEPSERVE_CPU_KERNELS=0, `library()` is
None and callers use their PyTorch reference.

OpenMP: torch's CPU wheels ship their own libgomp.so.1. torch is imported before our library loads, so
the dynamic linker resolves our libgomp.so.1 dependency to the copy already in the process (same soname):
one OpenMP runtime and one thread pool, not two (tests/kernels checks this).

    DecodePlan    one query token per sequence over the paged KV cache (fp32, bf16, fp8): built once per step from
                  the decode rows' block tables, then run per layer
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from deepserve import envs
from deepserve.kernels.cpu import build as _build
from deepserve.kernels.cpu import isa

_SOURCE = Path(__file__).with_name("paged_attention.c")
_P, _I64 = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P, _I64, _I64,                    # q, its row and head strides
             _P, _P,                            # k_cache, v_cache
             _P, _P, _P,                        # rows, block_tables, seq_lens
             _P, _I64, _I64,                    # out, its row and head strides
             _I64, _I64, _I64, _I64, _I64, _I64,   # B, H, Hkv, D, block_size, max_blocks
             _I64,                              # window (0: none)
             ctypes.c_float, ctypes.c_int]      # scale, num_threads


def enabled() -> bool:
    return envs.DEEPSERVE_CPU_KERNELS


# Cache dtype -> the build of paged_attention.c that reads it.
_VARIANTS = {torch.float32: (), torch.bfloat16: ("KV_BF16",), torch.float8_e4m3fn: ("KV_FP8_E4M3",),
             torch.float8_e5m2: ("KV_FP8_E5M2",)}


@functools.lru_cache(maxsize=None)
def _load(cache_dtype: torch.dtype = torch.float32) -> ctypes.CDLL | None:
    # DEEPSERVE_CPU_ISA's width first: a define the caller's variant forces (a test's ATTN_LANES) comes later and wins.
    return _build.load(_SOURCE, {"paged_decode_attention": _ARGTYPES},
                       defines=isa.vector_width_defines() + _VARIANTS[cache_dtype])


def library(cache_dtype: torch.dtype = torch.float32) -> ctypes.CDLL | None:
    """The kernels for a KV cache of `cache_dtype` (float32, bfloat16, float8_e4m3fn, float8_e5m2), or None (another
    dtype, disabled by DEEPSERVE_CPU_KERNELS=0, or not buildable here)."""
    return _load(cache_dtype) if enabled() and cache_dtype in _VARIANTS else None


class DecodePlan:
    """One step's decode sequences, checked once and shared by every layer's `run`.

    rows: [B] the q/out row of each decode sequence; block_tables: [B, max_blocks]; seq_lens: [B] keys per
    sequence (integer CPU tensors). The maxima kept here let each layer check, with a few integer
    comparisons, that the C code cannot index outside its tensors. Build one only when `library()` is
    not None.
    """

    def __init__(self, rows: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
        if library() is None:
            raise RuntimeError("the CPU kernels are not available here (see library())")
        if not (rows.is_cpu and block_tables.is_cpu and seq_lens.is_cpu):
            raise ValueError("DecodePlan takes CPU tensors")
        # Kept as attributes so that the memory behind the pointers below stays alive.
        self.rows, self.block_tables, self.seq_lens = (t.to(torch.int64).contiguous()
                                                      for t in (rows, block_tables, seq_lens))
        self.num_seqs, self.max_blocks = self.block_tables.shape
        if self.rows.shape != (self.num_seqs,) or self.seq_lens.shape != (self.num_seqs,):
            raise ValueError("rows and seq_lens need one entry per block table row")
        self.max_row, self.max_block, self.max_len = -1, -1, 0
        if self.num_seqs:
            lows = [int(t.min()) for t in (self.rows, self.block_tables, self.seq_lens) if t.numel()]
            if min(lows) < 0:
                raise ValueError("negative row, block or length")
            self.max_row, self.max_len = int(self.rows.max()), int(self.seq_lens.max())
            self.max_block = int(self.block_tables.max()) if self.max_blocks else -1
        self._ptrs = (self.rows.data_ptr(), self.block_tables.data_ptr(), self.seq_lens.data_ptr())

    def supports(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor) -> bool:
        """Whether the kernel can take these tensors (else use the PyTorch path)."""
        f32 = torch.float32
        if not (q.dtype == f32 and out.dtype == f32 and kv_cache.dtype in _VARIANTS
                and q.is_cpu and out.is_cpu and kv_cache.is_cpu and kv_cache.is_contiguous()
                and library(kv_cache.dtype) is not None):
            return False
        _, num_blocks, block_size, hkv, d = kv_cache.shape
        rows, heads, dim = q.shape
        return (q.stride(2) == 1 and out.stride(2) == 1 and out.shape == q.shape and dim == d
                and d % 32 == 0 and d <= 256   # pairs of 16-float vectors, at most 16 of them per head
                and heads % hkv == 0 and self.max_row < rows and self.max_block < num_blocks
                and self.max_len <= self.max_blocks * block_size)

    def run(self, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, scale: float, window: int = 0) -> bool:
        """out[rows[b]] = softmax(q[rows[b]] K_b^T * scale) V_b per head, K_b and V_b being sequence b's first
        seq_lens[b] keys and values in kv_cache [2, num_blocks, block_size, Hkv, D] (fp32, bf16, fp8); the last
        `window` of them where window > 0 (a sliding window). q, out:
        [T, H, D] fp32, unit stride in D (rows and heads may be strided); out's other rows are left as they are.
        Returns False, doing nothing, when the kernel cannot take these tensors (see `supports`)."""
        if not self.supports(q, kv_cache, out):
            return False
        _, _, block_size, hkv, d = kv_cache.shape
        k_ptr = kv_cache.data_ptr()
        v_ptr = k_ptr + kv_cache.stride(0) * kv_cache.element_size()
        q_stride, out_stride = q.stride(), out.stride()
        library(kv_cache.dtype).paged_decode_attention(q.data_ptr(), q_stride[0], q_stride[1], k_ptr, v_ptr, *self._ptrs,
                     out.data_ptr(), out_stride[0], out_stride[1], self.num_seqs, q.shape[1], hkv, d, block_size,
                     self.max_blocks, max(0, window), scale, torch.get_num_threads())
        return True


__all__ = ["enabled", "library", "DecodePlan"]
