"""DeepSeek's FP8 block-quantized checkpoints, dequantized while loading.

A quantized linear weight W [N, K] ships as `<name>.weight` in float8_e4m3fn plus `<name>.weight_scale_inv`
[ceil(N / bn), ceil(K / bk)] float32: one scale per bn x bk block (128 x 128 in DeepSeek-V3, from
`quantization_config.weight_block_size`); the real value is fp8 * scale ("scale_inv" because the quantizer
divided by it). Edge blocks are partial. Everything else in the checkpoint (embeddings, norms, the router,
the LM head) is stored unquantized and passes through untouched.

The engine computes in bf16/fp32 for now, so weights are widened here; FP8 GEMMs on the GPU path would keep
the fp8 tensor and its scales instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_SUFFIX = "_scale_inv"


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
