"""FP4 (e2m1) weights with E8M0 scales: DeepSeek-V4.1's routed experts (spec §3, §16.3).

An expert weight W [out, in] ships packed two values per byte as `<module>.weight` [out, in/2] (I8, U8 accepted)
plus `<module>.scale` [out, ceil(in/32)] F8_E8M0: one power-of-two scale per 32 consecutive inputs of a row.
Byte j of a row holds elements 2j and 2j+1; the LOW nibble is the even (first) element (§16.3).

A nibble is e2m1: bit 3 the sign, bits 2..0 index the magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6} (2 exponent bits
with bias 1 and 1 mantissa bit: exponent field 0 is subnormal, so code 1 is 0.5).
"""

from __future__ import annotations

import torch

from deepserve.loader.fp8 import e8m0_to_float, float_to_e8m0

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
SIGN_BIT = 0x8
FP4_BLOCK = 32                 # inputs per scale
PACKED_DTYPES = (torch.int8, torch.uint8)

# Rounding a magnitude to the nearest code: between two neighbours the midpoint decides, and an exact midpoint
# goes to the even code (round half to even, as IEEE rounding does on the mantissa bit). Midpoints whose upper
# neighbour is even round up (count with >=), the others round down (count with >).
_MIDPOINTS_TIE_DOWN = (0.25, 1.25, 2.5, 5.0)     # 0|0.5, 1|1.5, 2|3, 4|6: lower code even
_MIDPOINTS_TIE_UP = (0.75, 1.75, 3.5)            # 0.5|1, 1.5|2, 3|4: upper code even


def e2m1_codes_to_float(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (any integer dtype, values 0..15) -> float32 values."""
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    codes = codes.to(torch.int64)
    magnitude = table[codes & 0x7]
    return torch.where(codes & SIGN_BIT != 0, -magnitude, magnitude)


def float_to_e2m1_codes(values: torch.Tensor) -> torch.Tensor:
    """float values with |v| <= 6 -> nearest e2m1 codes (uint8, 0..15); zero keeps a clear sign bit."""
    magnitude = values.float().abs().clamp(max=E2M1_MAX).unsqueeze(-1)
    codes = ((magnitude > torch.tensor(_MIDPOINTS_TIE_DOWN)).sum(-1)
             + (magnitude >= torch.tensor(_MIDPOINTS_TIE_UP)).sum(-1))
    negative = (values < 0) & (codes > 0)
    return (codes + negative * SIGN_BIT).to(torch.uint8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """[..., n/2] bytes (int8 or uint8) -> [..., n] float32 e2m1 values, low nibble first (§16.3)."""
    if packed.dtype not in PACKED_DTYPES:
        raise TypeError(f"packed FP4 must be int8 or uint8, got {packed.dtype}")
    u8 = packed.view(torch.uint8)
    codes = torch.stack((u8 & 0xF, u8 >> 4), dim=-1)          # (even, odd) element of each byte
    return e2m1_codes_to_float(codes).flatten(-2)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """[..., n] codes (n even) -> [..., n/2] int8 bytes: element 2j in the low nibble, 2j+1 in the high one."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packs two values per byte: the last dim must be even, got {codes.shape[-1]}")
    pairs = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    return (pairs[..., 0] | (pairs[..., 1] << 4)).view(torch.int8)


def fp4_scale_shape(out_features: int, in_features: int) -> tuple[int, int]:
    return out_features, -(-in_features // FP4_BLOCK)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed [out, in/2] + E8M0 scale [out, ceil(in/32)] -> weight [out, in] in `dtype`."""
    values = unpack_fp4(packed)
    out, k = values.shape
    if tuple(scale.shape) != fp4_scale_shape(out, k):
        raise ValueError(f"FP4 scale shape {tuple(scale.shape)} does not fit a {out}x{k} weight in blocks of "
                         f"{FP4_BLOCK} inputs (expected {fp4_scale_shape(out, k)})")
    per_value = e8m0_to_float(scale).repeat_interleave(FP4_BLOCK, dim=1)[:, :k]
    return (values * per_value).to(dtype)


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse, for writers and tests: weight [out, in] -> (packed int8 [out, in/2], E8M0 scale [out,
    ceil(in/32)]). Each block's scale is the smallest power of two bringing its max magnitude to <= 6, so values
    already on the e2m1 grid times a power of two come back exactly."""
    out, k = weight.shape
    blocks = -(-k // FP4_BLOCK)
    padded = weight.float().new_zeros(out, blocks * FP4_BLOCK)
    padded[:, :k] = weight.float()
    grouped = padded.view(out, blocks, FP4_BLOCK)
    scale = float_to_e8m0(grouped.abs().amax(dim=-1) / E2M1_MAX)
    codes = float_to_e2m1_codes(grouped / e8m0_to_float(scale)[..., None]).view(out, -1)[:, :k]
    return pack_fp4(codes), scale
