"""Paged attention in plain PyTorch: the twin of kernels/paged_attention.py (and of the CPU C decode kernel).

KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = keys, 1 = values); a slot is
block * block_size + offset. The attention functions take keys already gathered from the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The 8-bit float dtypes a KV cache may hold (kv_cache_dtype "fp8" / "fp8_e5m2"; config.py maps the names).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# torch >= 2.5 lets SDPA broadcast kv heads over query groups without copying them.
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """An 8-bit float cache as its raw bytes (same shape), for gathers, scatters and copies: PyTorch's index kernels
    do not take float8 dtypes on every device and version, and a code moves bit for bit anyway."""
    return cache.view(torch.uint8) if cache.dtype in FP8_DTYPES else cache


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache[blocks] for a cache [num_blocks, ...]: index_select on a 2-D view copies each block as one
    row, several times faster than advanced indexing on the full shape."""
    rows = as_bytes(cache).reshape(cache.shape[0], -1).index_select(0, blocks.reshape(-1)).view(cache.dtype)
    return rows.view(*blocks.shape, *cache.shape[1:])


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x rounded (to nearest, ties to even) into the cache's dtype. An 8-bit float cache's values are first clamped to
    its largest finite value (448 for E4M3, 57344 for E5M2), so an outlier becomes that value, never NaN or inf:
    PyTorch's own casts saturate on some versions and not others, and the clamp makes every path (this one, the
    Triton kernels, the C kernels) round the same way."""
    if cache_dtype in FP8_DTYPES:
        limit = torch.finfo(cache_dtype).max
        x = x.clamp(-limit, limit)
    return x.to(cache_dtype)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The cache may hold another dtype than the activations (kv_cache_dtype): values are rounded into it
    (`to_cache_dtype`); readers widen them back."""
    raw = as_bytes(kv_cache)
    raw[0].view(-1, *k.shape[1:])[slot_mapping] = as_bytes(to_cache_dtype(k, kv_cache.dtype))
    raw[1].view(-1, *v.shape[1:])[slot_mapping] = as_bytes(to_cache_dtype(v, kv_cache.dtype))


def write_latents(kv_cache: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """MLA's latent cache [num_blocks, block_size, r + rope]: slot <- [latent | k_pe], rounded into the cache's dtype
    as `write_kv` rounds keys and values."""
    row = as_bytes(to_cache_dtype(torch.cat((latent, k_pe), dim=-1), kv_cache.dtype))
    as_bytes(kv_cache).view(-1, kv_cache.shape[-1])[slot_mapping] = row


def masked_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """q: [B, H, D]; k, v: [B, L, Hkv, D]; mask: [B, L] True at real keys. Grouped-query: H = Hkv * G."""
    b, h, d = q.shape
    hkv = k.shape[2]
    qg = q.view(b, hkv, h // hkv, d).float()
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1).float()) * scale          # [B, Hkv, G, L]
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v.permute(0, 2, 1, 3).float())                  # [B, Hkv, G, D]
    return out.reshape(b, h, d).to(q.dtype)


def window_start(seq_len: int, window: int) -> int:
    """The first key a query at position seq_len - 1 sees through a sliding window of `window` keys (0: no window):
    HF transformers' rule, key j visible to query i when i - window < j <= i."""
    return max(0, seq_len - window) if window > 0 else 0


def causal_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_position: int,
                             scale: float, window: int = 0) -> torch.Tensor:
    """q: [n, H, D] at positions first_position..; k, v: [L, Hkv, D] (L = first_position + n), widened to q's dtype
    when the cache holds another. `window` > 0: query i sees only the `window` keys ending at its own position."""
    n, h, _ = q.shape
    k, v = k.to(q.dtype), v.to(q.dtype)
    group = h // k.shape[1]
    if _SDPA_HAS_GQA:
        gqa = {"enable_gqa": group > 1}
    else:
        k, v, gqa = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), {}
    qh, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)    # [heads, len, D]
    if first_position == 0 and window <= 0:
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, **gqa)
    else:
        # Query i sits at position first_position + i and sees keys 0..first_position + i (the last `window` of them).
        key_pos = torch.arange(k.shape[1], device=q.device)
        query_pos = torch.arange(first_position, first_position + n, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        if window > 0:
            mask &= key_pos[None, :] > query_pos[:, None] - window
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, **gqa)
    return out.transpose(0, 1)


__all__ = ["as_bytes", "causal_prefill_attention", "gather_blocks", "masked_decode_attention", "to_cache_dtype",
           "window_start", "write_kv", "write_latents"]
