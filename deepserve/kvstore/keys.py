"""What names a stored KV block: the model's fingerprint and the block's chained prefix hash.

An entry is valid for exactly one (weights, dtype, KV layout, block size) and one whole token prefix:
- the chained hash (engine/block_manager.hash_block) covers every token of the prefix up to the block's end;
- the fingerprint covers what else decides the KV values and their bytes: the model's config, a sample of every
  weight (two checkpoints of one architecture differ there), the quantization, the compute and cache dtypes,
  the block size and each layer's per-block cache shape. A different model never reads another's entries.
Both are 16-byte blake2b digests; `FORMAT_VERSION` changes whenever the layout of what is stored changes.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

FORMAT_VERSION = 1
_WEIGHT_SAMPLE = 64        # values of each parameter hashed (the first ones, flattened): cheap, and enough to tell
                           # two random inits or two fine-tunes apart


def layer_layout(layer: Any) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) of one block of a layer's cache: the cache with its block dimension taken out."""
    cache = layer.kv_cache
    shape = list(cache.shape)
    del shape[layer.kv_block_dim]
    return tuple(shape), cache.dtype


def weights_digest(model: torch.nn.Module) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    for name, t in sorted(tensors, key=lambda nt: nt[0]):
        if t.is_meta or t.numel() == 0:
            continue
        sample = t.detach().reshape(-1)[:_WEIGHT_SAMPLE].cpu().contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(sample.view(torch.uint8).numpy().tobytes())
    return h.digest()


def model_fingerprint(model: torch.nn.Module, layers: list, hf_config: dict[str, Any], dtype: torch.dtype,
                      block_size: int, quantization: str | None, batch_invariant: bool = False) -> bytes:
    """16 bytes naming everything besides the tokens that decides a block's stored KV. Batch-invariant mode computes
    other bits (its GEMM and attention orders), so its entries get their own names (the default mode's are kept)."""
    h = hashlib.blake2b(digest_size=16)
    layout = [(list(shape), str(dt), layer.kv_block_dim) for layer, (shape, dt) in
              zip(layers, map(layer_layout, layers))]
    named = {"version": FORMAT_VERSION, "config": hf_config, "dtype": str(dtype), "block_size": block_size,
             "quantization": quantization, "layout": layout}
    if batch_invariant:
        named["batch_invariant"] = True
    h.update(json.dumps(named, sort_keys=True, default=str).encode())
    h.update(weights_digest(model))
    return h.digest()


def entry_name(fingerprint: bytes, block_hash: bytes) -> str:
    """The entry's name in every tier (a file name, a Redis key suffix): both digests in hex."""
    return f"{fingerprint.hex()}-{block_hash.hex()}"
