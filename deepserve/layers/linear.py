"""Linear layers: `F.linear`, except for one activation row on the GPU (batch-1 decode), where a Triton GEMV reads
the weight faster than cuBLAS does (deepserve/kernels/gemv.py has the measurements), and for 2-32 rows (small-batch
decode; 2-16 for narrow weights of rows 2049-4095 long), where the skinny Triton GEMM takes them
(deepserve/kernels/skinny_gemm.py); and for 1-32 float32 rows on the CPU, where kernels/cpu/invariant_linear.c
streams the weight faster than the BLAS (`_few_rows_on_cpu`).

Models build `Linear` (an nn.Linear: loading, quantization and `isinstance` checks see no difference) and call
`linear()` where they multiply by a weight they do not own as a module (a tied LM head).

Batch-invariant mode (`EngineArgs(batch_invariant=True)`; `layers/batch_invariant.py` switches a model's layers at
load): `Linear.batch_invariant` makes a layer compute every output row in one summation order that depends on K
alone, not on how many rows share the call nor where the row sits among them (`invariant_linear`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepserve import envs
from deepserve.layers.kernel_dispatch import use_triton

# A/B switch (DEEPSERVE_SKINNY_GEMM=0): GEMMs of 2-32 rows on the GPU stay on cuBLAS.
_SKINNY = envs.DEEPSERVE_SKINNY_GEMM
# float32 CPU GEMMs of up to this many rows take the C kernel (0: F.linear always; `_few_rows_on_cpu` says why).
_CPU_FEW_ROWS = envs.DEEPSERVE_CPU_FEW_ROW_LINEAR

_GEMV_DTYPES = (torch.bfloat16, torch.float16)

# Rows per F.linear call in the batch-invariant fallback: every call has this one shape, padded.
INVARIANT_ROW_TILE = 32


def one_row_on_gpu(x: torch.Tensor) -> bool:
    """One activation row of a half-precision dtype on the GPU, no autograd: where the GEMV kernels apply."""
    # use_triton first (it tests x.is_cuda first): the CPU path pays one attribute read per layer.
    return (use_triton(x) and x.dim() == 2 and x.shape[0] == 1 and x.dtype in _GEMV_DTYPES
            and not torch.is_grad_enabled())


def _one_row_on_gpu(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return one_row_on_gpu(x) and x.dtype == weight.dtype


def _few_rows_on_gpu(x: torch.Tensor, weight: torch.Tensor, swiglu: bool = False) -> bool:
    """2-32 (2-16: skinny_max_rows) activation rows of weight's half-precision dtype on the GPU, no autograd: where the
    skinny GEMM applies (a decode step of a small batch; kernels/skinny_gemm.py says why cuBLAS is slow there); up
    to 64 for some weights under DEEPSERVE_SKINNY_64_ROWS (`swiglu`: a gate/up weight with the SwiGLU fused).
    (Session 38's few-row modes, the RMSNorms, residual adds and rotary write inside these GEMMs, lost in decode
    steps twice and were removed: benchmarks/s38_switches_1b_ab_h100_s40.json, docs/gpu.md.)"""
    if not (_SKINNY and use_triton(x)):
        return False
    from deepserve.kernels.skinny_gemm import skinny_applies
    return skinny_applies(x, weight, swiglu)


def _few_rows_on_cpu(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """1-32 float32 activation rows on the CPU, no autograd: where kernels/cpu/invariant_linear.c beats F.linear. Its
    threads each stream whole weight rows; MKL's GEMV / small GEMM read the weight at 8-16 GB/s on an AVX2 EPYC
    against its 20-27 (a model's worth of distinct weights, 1-4 rows: cpu_invariant_linear_stream_avx2_s53.json),
    and the default model's fp32 decode ran ~1.3x (batch 1) to ~2x (batch 4) faster through it
    (benchmarks/cpu_few_row_linear_ab_*_s53.json). What the kernel cannot take (K not a multiple of 16, a strided
    weight) falls back to F.linear."""
    return (x.is_cpu and x.dim() == 2 and x.shape[0] <= _CPU_FEW_ROWS and x.dtype is torch.float32
            and weight.dtype is torch.float32 and not torch.is_grad_enabled())


def _cpu_few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from deepserve.kernels.cpu.invariant_linear import invariant_linear as c_linear
    y = c_linear(x, weight, bias)
    return F.linear(x, weight, bias) if y is None else y


def _plain(layer: nn.Module) -> bool:
    """A plain `Linear` (not quantized) outside batch-invariant mode: a fused GEMV may stand in for it."""
    return type(layer) is Linear and not layer.batch_invariant


def _norm_fits(norm: nn.Module | None, x: torch.Tensor) -> bool:
    """A GEMV can run `norm` (an RMSNorm) in its prologue: its weight has x's dtype."""
    return norm is None or norm.weight.dtype == x.dtype


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) where each output row is a function of its own input row alone, bit for bit.

    On a CUDA device with Triton: kernels/invariant_matmul.py (fixed tiles, one K order). On the CPU in float32 with
    K a multiple of 16: the C kernel of kernels/cpu/invariant_linear.c (one fixed summation order per element).
    Elsewhere: F.linear over tiles of exactly INVARIANT_ROW_TILE rows (the last one
    zero-padded), each in a fresh buffer of the same shape and alignment, so that the library runs one kernel for
    every row; that relies on the library being deterministic for a fixed shape (tests check it on the host)."""
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    if use_triton(flat):
        # One fixed tiling and K order for every row count (kernels/invariant_matmul.py): one launch, not a loop of
        # padded cuBLAS calls whose algorithm choice for that shape we would have to trust.
        from deepserve.kernels.invariant_matmul import invariant_linear as triton_invariant_linear
        return triton_invariant_linear(flat, weight, bias).view(*lead, weight.shape[0])
    if flat.is_cpu:
        from deepserve.kernels.cpu.invariant_linear import invariant_linear as c_invariant_linear
        out = c_invariant_linear(flat, weight, bias)
        if out is not None:
            return out.view(*lead, weight.shape[0])
    return _tiled_linear(flat, weight, bias).view(*lead, weight.shape[0])


def _tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear over zero-padded tiles of INVARIANT_ROW_TILE rows (one call shape for every row)."""
    rows, tile = x.shape[0], INVARIANT_ROW_TILE
    padded = x.new_zeros(-(-rows // tile) * tile, x.shape[1])
    padded[:rows] = x
    tiles = [F.linear(padded[i:i + tile].clone(), weight, bias) for i in range(0, padded.shape[0], tile)]
    return torch.cat(tiles)[:rows] if tiles else x.new_empty(0, weight.shape[0])


def _writes_into(out: torch.Tensor | None, x: torch.Tensor) -> bool:
    """Whether a Triton GEMV / skinny GEMM of x [rows, K] can write its product into `out` itself."""
    return out is not None and out.dtype == x.dtype and out.is_contiguous() and x.dim() == 2


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           batch_invariant: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias; `batch_invariant`: through `invariant_linear` (a row's result is independent of its
    batch). `out` ([rows, N], contiguous): the result is written there and returned; cuBLAS's, the GEMV's and the
    skinny GEMM's products go there straight (a CUDA graph's LM head into its static logits: no [rows, vocab] copy),
    the other paths' are copied."""
    if batch_invariant:
        y = invariant_linear(x, weight, bias)
    elif _one_row_on_gpu(x, weight) and (bias is None or bias.dtype == weight.dtype):
        from deepserve.kernels.gemv import gemv
        if _writes_into(out, x):
            return gemv(x, weight, bias, out=out)      # straight into `out` (a graph's logits: no copy launch)
        y = gemv(x, weight, bias)
    elif _few_rows_on_gpu(x, weight) and (bias is None or (bias.dtype == weight.dtype and bias.is_contiguous())):
        from deepserve.kernels.skinny_gemm import skinny_linear
        if _writes_into(out, x):
            return skinny_linear(x, weight, bias, out=out)
        y = skinny_linear(x, weight, bias)
    elif _few_rows_on_cpu(x, weight):
        y = _cpu_few_rows_linear(x, weight, bias)
    elif out is not None and bias is None and x.dim() == 2 and out.dtype == x.dtype == weight.dtype:
        return torch.mm(x, weight.t(), out=out)
    else:
        y = F.linear(x, weight, bias)
    return y if out is None else out.copy_(y)


def apply_linear(layer: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """layer(x), written into `out` when given (`linear`'s: straight from cuBLAS for a plain Linear; copied from
    any other layer, e.g. a quantized one)."""
    if type(layer) is Linear:
        return linear(x, layer.weight, layer.bias, layer.batch_invariant, out=out)
    y = layer(x)
    return y if out is None else out.copy_(y)


def linear_residual(x: torch.Tensor, layer: nn.Module, residual: torch.Tensor) -> torch.Tensor:
    """layer(x) + residual; for one row on the GPU through a plain `Linear`, the add runs in the GEMV's epilogue
    (the same two roundings: the product's, the sum's)."""
    if not (_plain(layer) and residual.dtype == x.dtype):
        return layer(x) + residual
    if _one_row_on_gpu(x, layer.weight) and (layer.bias is None or layer.bias.dtype == x.dtype):
        from deepserve.kernels.gemv import gemv
        return gemv(x, layer.weight, layer.bias, residual=residual)
    return layer(x) + residual


def fused_swiglu_linear(x: torch.Tensor, gate_up: nn.Module, limit: float | None,
                        norm: nn.Module | None = None) -> torch.Tensor | None:
    """swiglu_activation(gate_up(x), limit) in one GEMV launch (the SwiGLU in its epilogue) for one row on the GPU
    through a plain `Linear` without bias; of norm(x) with `norm` (an RMSNorm, run in the GEMV's prologue). For 2-32
    rows (skinny_max_rows) without `norm`, the skinny GEMM with the SwiGLU in its epilogue. None otherwise (a
    quantized layer, more rows, a norm past one row, the CPU): the caller then runs the steps one by one."""
    if not (_plain(gate_up) and gate_up.bias is None):
        return None
    if _one_row_on_gpu(x, gate_up.weight) and _norm_fits(norm, x):
        from deepserve.kernels.gemv import swiglu_gemv
        return swiglu_gemv(x, gate_up.weight, limit, norm=norm)
    if norm is None and _few_rows_on_gpu(x, gate_up.weight, swiglu=True):
        from deepserve.kernels.skinny_gemm import skinny_swiglu
        return skinny_swiglu(x, gate_up.weight, limit)
    return None


def fused_two_linear(x: torch.Tensor, a: nn.Module, b: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(a(x), b(x)) in one launch through two plain `Linear`s without bias (MLA's q and kv_a projections): the GEMV
    for one row on the GPU, the skinny GEMM for a few rows where it takes both weights; None otherwise: the caller
    applies them one by one."""
    if not (_plain(a) and _plain(b) and a.bias is None and b.bias is None and b.weight.dtype == a.weight.dtype):
        return None
    if _one_row_on_gpu(x, a.weight):
        from deepserve.kernels.gemv import gemv_two
        return gemv_two(x, a.weight, b.weight)
    if _few_rows_on_gpu(x, a.weight) and _few_rows_on_gpu(x, b.weight):
        from deepserve.kernels.skinny_gemm import skinny_linear_two
        return skinny_linear_two(x, a.weight, b.weight)
    return None


def fused_qkv_rotary_rows(x: torch.Tensor) -> bool:
    """x has the row count `fused_qkv_rotary_write` takes (a cheap first test): one."""
    return x.shape[0] == 1


def fused_qkv_rotary_write(x: torch.Tensor, qkv_proj: nn.Module, kv_cache: torch.Tensor, batch, rotary,
                           num_heads: int, num_kv_heads: int, norm: nn.Module | None = None) -> torch.Tensor | None:
    """Batch-1 decode on the GPU (one row): (the RMSNorm `norm` of x,) the qkv projection (a plain `Linear`, q then
    k then v rows), the NeoX rotary embedding of q and k at batch.positions, and the write of k and v at
    batch.slot_mapping, in one GEMV launch (kernels/qkv_rotary.py) -> q rotated [1, H, D]. None where that path does
    not apply (the caller runs the norm and the projection, then the attention backend's rotary + cache write)."""
    if not (_plain(qkv_proj) and _norm_fits(norm, x)):
        return None
    if _one_row_on_gpu(x, qkv_proj.weight) and (qkv_proj.bias is None or qkv_proj.bias.dtype == x.dtype):
        from deepserve.kernels.qkv_rotary import qkv_rotary_write
        return qkv_rotary_write(x, qkv_proj.weight, qkv_proj.bias, kv_cache, batch.slot_mapping, batch.positions,
                                rotary.cos_cache, rotary.sin_cache, num_heads, num_kv_heads, norm=norm)
    return None


class Linear(nn.Linear):
    batch_invariant = False     # set per layer by layers/batch_invariant.py

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.batch_invariant)
