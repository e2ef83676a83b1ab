"""Counter-based uniforms: a pure function of (seed, position, case), so a row's randomness never depends on
which other rows share its batch, on their order, or on how many draws came before.

The construction (DeepInfer's spec) is the SplitMix64 finaliser applied to a hashed counter; all arithmetic
wraps at 64 bits and the result is the top 53 bits as a float64 in [0, 1):

    sample uniform:  s = (pos*3 + case) * GOLDEN;  u = SM(seed + (s ^ (s << 13)))      case 0 or 1
    verify uniform:  u = SM(seed ^ ((pos*3 + 2) * GOLDEN))

case 0 draws the token for normal sampling, case 1 the residual draw in speculative decoding, and the
verify uniform decides acceptance of a draft token; pos*3 + case keeps the three streams disjoint.

Three implementations, tested to agree bit for bit: a scalar pure-Python reference, numpy (uint64) for the
host, and torch int64 ops (emulating uint64) so a GPU can make the uniforms itself without a host round-trip.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np
import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_TO_UNIT = 1.0 / (1 << 53)      # exact: a power of two
_VERIFY_CASE = 2

CASE_SAMPLE = 0
CASE_RESIDUAL = 1


# --- scalar reference ---------------------------------------------------------------------------
def _splitmix64_reference(z: int) -> float:
    z = (z + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    z = z ^ (z >> 31)
    return (z >> 11) * _TO_UNIT


def splitmix64_uniform_reference(seed: int, pos: int, case: int = CASE_SAMPLE) -> float:
    """The spec written out one value at a time, with Python ints; case 2 is the verify uniform."""
    seed &= _MASK64
    s = ((pos * 3 + case) * _GOLDEN) & _MASK64
    if case == _VERIFY_CASE:
        return _splitmix64_reference(seed ^ s)
    return _splitmix64_reference((seed + (s ^ ((s << 13) & _MASK64))) & _MASK64)


# --- numpy --------------------------------------------------------------------------------------
def _as_u64(values: Iterable[int] | np.ndarray | int) -> np.ndarray:
    """Bit patterns as uint64: Python ints of any sign are taken mod 2**64, signed arrays are reinterpreted."""
    if isinstance(values, np.ndarray) and values.dtype.kind in "iu":
        return values.astype(np.int64).view(np.uint64) if values.dtype.kind == "i" else values.astype(np.uint64)
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if isinstance(values, (int, np.integer)):
        return np.array(int(values) & _MASK64, dtype=np.uint64)
    return np.array([int(v) & _MASK64 for v in values], dtype=np.uint64)


def _splitmix64_numpy(z: np.ndarray) -> np.ndarray:
    z = z + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * _TO_UNIT


def _counter(positions: np.ndarray, case: int) -> np.ndarray:
    return (positions * np.uint64(3) + np.uint64(case)) * np.uint64(_GOLDEN)


def _broadcast_u64(seeds, positions) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    # Work on 1-d arrays: numpy warns on overflow for scalar integer math but wraps silently for arrays.
    seed_arr, pos_arr = np.broadcast_arrays(_as_u64(seeds), _as_u64(positions))
    return seed_arr.ravel(), pos_arr.ravel(), seed_arr.shape


def sample_uniforms(seeds, positions, case: int = CASE_SAMPLE) -> np.ndarray:
    """Uniforms in [0, 1) for drawing a token: one per (seed, position), broadcast together."""
    if case not in (CASE_SAMPLE, CASE_RESIDUAL):
        raise ValueError(f"case must be {CASE_SAMPLE} (sample) or {CASE_RESIDUAL} (residual), got {case!r}")
    seed_arr, pos_arr, shape = _broadcast_u64(seeds, positions)
    with np.errstate(over="ignore"):
        s = _counter(pos_arr, case)
        return _splitmix64_numpy(seed_arr + (s ^ (s << np.uint64(13)))).reshape(shape)


def verify_uniforms(seeds, positions) -> np.ndarray:
    """Uniforms in [0, 1) for accepting or rejecting a draft token at each (seed, position)."""
    seed_arr, pos_arr, shape = _broadcast_u64(seeds, positions)
    with np.errstate(over="ignore"):
        return _splitmix64_numpy(seed_arr ^ _counter(pos_arr, _VERIFY_CASE)).reshape(shape)


# --- torch (int64 emulating uint64) ------------------------------------------------------------
def _as_int64(value: int) -> int:
    """The int64 with the same bit pattern as a uint64 constant."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _logical_shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    # int64 >> is arithmetic (copies the sign bit); masking off the copied bits makes it logical.
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64_torch(z: torch.Tensor) -> torch.Tensor:
    # int64 add and multiply wrap in two's complement, which is uint64 arithmetic on the same bits.
    z = z + _as_int64(_GOLDEN)
    z = (z ^ _logical_shift_right(z, 30)) * _as_int64(_MIX1)
    z = (z ^ _logical_shift_right(z, 27)) * _as_int64(_MIX2)
    z = z ^ _logical_shift_right(z, 31)
    return _logical_shift_right(z, 11).to(torch.float64) * _TO_UNIT


def _counter_torch(positions: torch.Tensor, case: int) -> torch.Tensor:
    return (positions * 3 + case) * _as_int64(_GOLDEN)


def torch_sample_uniforms(seeds: torch.Tensor, positions: torch.Tensor, case: int = CASE_SAMPLE) -> torch.Tensor:
    """sample_uniforms on int64 tensors holding uint64 bit patterns; float64 result on the inputs' device."""
    if case not in (CASE_SAMPLE, CASE_RESIDUAL):
        raise ValueError(f"case must be {CASE_SAMPLE} (sample) or {CASE_RESIDUAL} (residual), got {case!r}")
    s = _counter_torch(positions.to(torch.int64), case)
    return _splitmix64_torch(seeds.to(torch.int64) + (s ^ (s << 13)))


def torch_verify_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """verify_uniforms on int64 tensors holding uint64 bit patterns."""
    return _splitmix64_torch(seeds.to(torch.int64) ^ _counter_torch(positions.to(torch.int64), _VERIFY_CASE))


def seeds_to_int64(seeds: Iterable[int]) -> torch.Tensor:
    """Python ints (any sign, up to 2**64-1) as an int64 tensor with the same low 64 bits."""
    return torch.tensor([_as_int64(int(s) & _MASK64) for s in seeds], dtype=torch.int64)
