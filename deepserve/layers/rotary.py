"""Rotary position embedding (NeoX "rotate half" layout, as HF Llama/Qwen use), with a cos/sin cache.

`rope_scaling` variants: "default", "linear", "llama3" (Llama 3.1/3.2 frequency remapping) and "yarn".
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from deepserve.kernels.reference.rotary import apply_rotate_half
from deepserve.layers.kernel_dispatch import use_triton


def rope_parameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings from either config layout: transformers>=5 `rope_parameters` (theta inside), or the
    `rope_theta` + `rope_scaling` pair that released checkpoints ship. Always has rope_theta and rope_type."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    params.setdefault("rope_theta", cfg.get("rope_theta") or 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(dim: int, params: dict[str, Any], max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim / 2], factor applied to cos and sin), as transformers computes them."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    kind = params.get("rope_type", "default")
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, params), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, dim, base, params, max_position_embeddings)
    raise NotImplementedError(f"rope type {kind!r} is not supported (default, linear, llama3, yarn)")


def _yarn_inv_freq(inv_freq: torch.Tensor, dim: int, base: float, params: dict[str, Any],
                   max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    old_len = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / old_len
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    # Dimensions that turn fewer than beta_slow times over the original context are interpolated (slowed by
    # `factor`), those turning more than beta_fast times kept; a linear ramp blends the band between.
    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(params.get("beta_fast") or 32), correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    inv_freq = (inv_freq / factor) * (1 - extrapolated) + inv_freq * extrapolated
    return inv_freq, float(attention_factor)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: dict[str, Any] | None = None, max_position_embeddings: int | None = None) -> None:
        super().__init__()
        params = {**(scaling or {}), "rope_theta": base}
        params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
        inv_freq, attention_factor = rope_inv_freq(head_dim, params, max_position_embeddings or max_position)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # Not parameters: rebuilt from the config, never loaded from a checkpoint.
        self.register_buffer("cos_cache", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin_cache", emb.sin() * attention_factor, persistent=False)

    @classmethod
    def from_config(cls, head_dim: int, max_position: int, cfg: dict[str, Any]) -> "RotaryEmbedding":
        params = rope_parameters(cfg)
        return cls(head_dim, max_position, float(params["rope_theta"]), params,
                   cfg.get("max_position_embeddings", max_position))

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, Hkv, D]; positions: [T]. When k's heads directly follow q's in one buffer (views of
        the fused qkv projection, as the Llama layer hands them over), both are rotated as one tensor: one pass
        (one C call on the CPU) instead of two."""
        if use_triton(q):
            from deepserve.kernels.rotary import apply_rotary
            return apply_rotary(positions, q, k, self.cos_cache, self.sin_cache)
        qk = side_by_side(q, k)
        if qk is not None:
            return self.rotate(positions, qk).split([q.shape[1], k.shape[1]], dim=1)
        if q.is_cpu:
            q_rot, k_rot = self._rotate_in_c(positions, q), self._rotate_in_c(positions, k)
            if q_rot is not None and k_rot is not None:
                return q_rot, k_rot
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        return apply_rotate_half(q, cos, sin), apply_rotate_half(k, cos, sin)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] (any heads, e.g. q and k side by side) -> rotated copy."""
        if use_triton(x):
            from deepserve.kernels.rotary import rotate
            return rotate(positions, x, self.cos_cache, self.sin_cache)
        if x.is_cpu:
            out = self._rotate_in_c(positions, x)
            if out is not None:
                return out
        return apply_rotate_half(x, self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1))

    def _rotate_in_c(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """The C kernel's rotation (float32 CPU tensors: one call instead of ~9 ops), or None."""
        from deepserve.kernels.cpu.rotary import rotate_half
        return rotate_half(positions, x, self.cos_cache, self.sin_cache)


def side_by_side(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """[T, H + Hkv, D], one view of q [T, H, D] and k [T, Hkv, D] when k's heads directly follow q's in one buffer
    with the same strides; else None."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.dtype != k.dtype:
        return None
    same_rows = q.shape[0] <= 1 or q.stride(0) == k.stride(0)      # a single row's stride is never used
    if (not same_rows or q.stride()[1:] != k.stride()[1:]
            or k.storage_offset() != q.storage_offset() + q.shape[1] * q.stride(1)
            or q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()):
        return None
    return q.as_strided((q.shape[0], q.shape[1] + k.shape[1], q.shape[2]), q.stride())
