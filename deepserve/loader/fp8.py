"""DeepSeek's FP8 block-quantized checkpoints, dequantized while loading.

A quantized linear weight W [N, K] ships as `<name>.weight` in float8_e4m3fn plus `<name>.weight_scale_inv`
[ceil(N / bn), ceil(K / bk)] float32: one scale per bn x bk block (128 x 128 in DeepSeek-V3, from
`quantization_config.weight_block_size`); the real value is fp8 * scale ("scale_inv" because the quantizer
divided by it). Edge blocks are partial. Everything else in the checkpoint (embeddings, norms, the router,
the LM head) is stored unquantized and passes through untouched.

DeepSeek-V4.1 (spec §3, §16.3) ships the same e4m3 weights with power-of-two scales instead: `<module>.scale`
in F8_E8M0 (an exponent byte e meaning 2^(e-127), no sign, no mantissa) over 32 x 32 blocks; its Engram tables use
the same bytes with one scale per row and 32 columns. `e8m0_to_float` / `float_to_e8m0` and the `*_e8m0` pair
below cover that format (fp4.py reuses the E8M0 helpers for its expert scales).

The engine computes in bf16/fp32 for now, so weights are widened here; FP8 GEMMs on the GPU path would keep
the fp8 tensor and its scales instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"
E4M3_MAX = 448.0               # largest finite float8_e4m3fn: 2^8 x 1.75
E8M0_BIAS = 127                # E8M0 byte e -> 2^(e - 127)
E8M0_NAN = 255                 # the one non-number of E8M0 (OCP MX): no sign, no mantissa, no infinity
E8M0_BLOCK = (32, 32)          # DeepSeek-V4.1's weight_block_size (§2.1)


def weight_block_size(hf_config: dict[str, Any]) -> tuple[int, int]:
    quant = hf_config.get("quantization_config") or {}
    if quant and quant.get("quant_method", "fp8") != "fp8":
        raise NotImplementedError(f"quantization method {quant.get('quant_method')!r} is not supported")
    block = quant.get("weight_block_size") or (128, 128)
    return int(block[0]), int(block[1])


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight [N, K] fp8, scale_inv [ceil(N/bn), ceil(K/bk)] -> weight * scale per block, in `dtype`."""
    n, k = weight.shape
    bn, bk = block
    expected = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"scale shape {tuple(scale_inv.shape)} does not fit a {n}x{k} weight in "
                         f"{bn}x{bk} blocks (expected {expected})")
    scale = scale_inv.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return (weight.float() * scale).to(dtype)


def dequantize_weights(weights: Iterable[tuple[str, torch.Tensor]],
                       block: tuple[int, int]) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass a checkpoint stream through, replacing each (fp8 weight, its scale) pair by the dequantized
    weight. A weight and its scale may arrive in either order (or different shards): the first waits."""
    waiting_weights: dict[str, torch.Tensor] = {}
    waiting_scales: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            if base in waiting_weights:
                yield base, dequantize_block_fp8(waiting_weights.pop(base), tensor, block)
            else:
                waiting_scales[base] = tensor
        elif tensor.dtype in FP8_DTYPES:
            if name in waiting_scales:
                yield name, dequantize_block_fp8(tensor, waiting_scales.pop(name), block)
            else:
                waiting_weights[name] = tensor
        else:
            yield name, tensor
    if waiting_weights or waiting_scales:
        orphans = sorted(waiting_weights) + [n + SCALE_SUFFIX for n in sorted(waiting_scales)]
        raise ValueError(f"FP8 weights without scales (or scales without weights): {', '.join(orphans[:8])}")


def quantize_block_fp8(weight: torch.Tensor, block: tuple[int, int] = (128, 128)):
    """The inverse, for tests and tools: (fp8 weight, scale_inv), each block scaled so its max hits 448."""
    n, k = weight.shape
    bn, bk = block
    padded = weight.float().new_zeros(-(-n // bn) * bn, -(-k // bk) * bk)
    padded[:n, :k] = weight.float()
    blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / torch.finfo(torch.float8_e4m3fn).max
    quantized = (blocks / scale_inv[:, None, :, None]).view_as(padded)[:n, :k].to(torch.float8_e4m3fn)
    return quantized, scale_inv


# ---------------------------------------------------------------------------------------------------- E8M0 scales


def e8m0_bytes(scale: torch.Tensor) -> torch.Tensor:
    """The raw exponent bytes of an E8M0 tensor (float8_e8m0fnu, or uint8 holding the same bytes)."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8)
    if scale.dtype == torch.uint8:
        return scale
    raise TypeError(f"an E8M0 scale must be float8_e8m0fnu or uint8 bytes, got {scale.dtype}")


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Exponent byte e -> 2^(e - 127) in float32 (exact: float32 reaches 2^-149 through its subnormals);
    byte 255 -> NaN."""
    e = e8m0_bytes(scale).to(torch.int32)
    value = torch.ldexp(torch.ones(e.shape, dtype=torch.float32), e - E8M0_BIAS)
    return torch.where(e == E8M0_NAN, torch.full_like(value, float("nan")), value)


def float_to_e8m0(value: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= value (value > 0), as float8_e8m0fnu. Zero and values below 2^-127 clamp to
    2^-127. Exact ceil(log2) from frexp (value = m * 2^k, m in [0.5, 1)): 2^k, or 2^(k-1) when m is exactly 0.5."""
    mantissa, exponent = torch.frexp(value.float())
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    exponent = torch.where(value > 0, exponent, torch.full_like(exponent, -E8M0_BIAS))
    biased = (exponent + E8M0_BIAS).clamp(0, E8M0_NAN - 1)
    return biased.to(torch.uint8).view(torch.float8_e8m0fnu)


# ------------------------------------------------------------------------------ FP8 with E8M0 block scales (V4.1)


def dequantize_block_fp8_e8m0(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = E8M0_BLOCK,
                              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """weight [N, K] float8_e4m3fn, scale [ceil(N/bn), ceil(K/bk)] E8M0 -> weight * 2^(e - 127) per block."""
    return dequantize_block_fp8(weight, e8m0_to_float(scale), block, dtype)


def quantize_block_fp8_e8m0(weight: torch.Tensor, block: tuple[int, int] = E8M0_BLOCK
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, for writers and tests: (float8_e4m3fn weight, E8M0 scale). Each block's scale is the smallest
    power of two that brings its max magnitude to <= 448, so nothing saturates; a power-of-two scale makes the
    division exact, so e4m3's round-to-nearest-even is the only rounding."""
    n, k = weight.shape
    bn, bk = block
    padded = weight.float().new_zeros(-(-n // bn) * bn, -(-k // bk) * bk)
    padded[:n, :k] = weight.float()
    blocks = padded.view(padded.shape[0] // bn, bn, padded.shape[1] // bk, bk)
    scale = float_to_e8m0(blocks.abs().amax(dim=(1, 3)) / E4M3_MAX)
    quantized = (blocks / e8m0_to_float(scale)[:, None, :, None]).view_as(padded)[:n, :k]
    return quantized.to(torch.float8_e4m3fn), scale
