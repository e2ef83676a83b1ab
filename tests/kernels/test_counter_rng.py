"""Counter-based uniforms: scalar reference == numpy == torch, known answers, rough uniformity."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from deepserve.kernels.reference.counter_rng import (
    sample_uniforms,
    seeds_to_int64,
    splitmix64_uniform_reference,
    torch_sample_uniforms,
    torch_verify_uniforms,
    verify_uniforms,
)

GOLDEN = 0x9E3779B97F4A7C15
U64 = (1 << 64) - 1
EDGE_SEEDS = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, -1, -(2**63), -12345, GOLDEN]
EDGE_POSITIONS = [0, 1, 2, 3, 2**31, 2**40, 2**61 + 3]


def random_seeds_and_positions(count: int, rng_seed: int = 0) -> tuple[list[int], list[int]]:
    rng = random.Random(rng_seed)
    seeds = EDGE_SEEDS + [rng.choice([rng.getrandbits(64), -rng.getrandbits(63), rng.randrange(1000)])
                          for _ in range(count)]
    positions = EDGE_POSITIONS + [rng.choice([rng.randrange(1 << 20), rng.getrandbits(62)]) for _ in range(count)]
    n = min(len(seeds), len(positions))
    return seeds[:n], positions[:n]


def unit(top53: int) -> float:
    return top53 / 2**53


# Published SplitMix64 outputs (Vigna's splitmix64.c / Java's SplittableRandom). With pos=0, case=0 the counter
# term is 0, so sample_uniform(seed, 0) = SM(seed) is the first output of a SplitMix64 stream seeded with `seed`,
# and SM(seed + k*GOLDEN) is its (k+1)-th output.
SPLITMIX64_SEED_1234567 = [6457827717110365317, 3203168211198807973, 9817491932198370423,
                           4593380528125082431, 16408922859458223821]


def test_known_answers_from_published_splitmix64():
    assert splitmix64_uniform_reference(0, 0) == unit(0xE220A8397B1DCDAF >> 11)
    for k, expected in enumerate(SPLITMIX64_SEED_1234567):
        seed = (1234567 + k * GOLDEN) & U64
        assert splitmix64_uniform_reference(seed, 0) == unit(expected >> 11)
        assert sample_uniforms([seed], [0])[0] == unit(expected >> 11)


# Worked by hand from the formula with plain Python ints (top 53 bits as integers, so the check is exact).
@pytest.mark.parametrize("seed, pos, case, top53", [
    (42, 7, 0, 2512845889235651),
    (42, 7, 1, 2686900620564290),
    (2**64 - 1, 100, 0, 4838892471360637),
    (-1, 100, 0, 4838892471360637),
    (123456789, 0, 1, 5360291823133408),
])
def test_known_sample_values(seed, pos, case, top53):
    assert splitmix64_uniform_reference(seed, pos, case) == unit(top53)
    assert sample_uniforms([seed], [pos], case)[0] == unit(top53)
    assert torch_sample_uniforms(seeds_to_int64([seed]), torch.tensor([pos]), case).item() == unit(top53)


@pytest.mark.parametrize("seed, pos, top53", [(42, 7, 6157924523969418), (0, 0, 238094247788840),
                                              (-7, 3, 4852141384851678)])
def test_known_verify_values(seed, pos, top53):
    assert splitmix64_uniform_reference(seed, pos, 2) == unit(top53)
    assert verify_uniforms([seed], [pos])[0] == unit(top53)
    assert torch_verify_uniforms(seeds_to_int64([seed]), torch.tensor([pos])).item() == unit(top53)


@pytest.mark.parametrize("case", [0, 1])
def test_numpy_and_torch_match_reference_bit_for_bit(case):
    seeds, positions = random_seeds_and_positions(2000, rng_seed=case)
    reference = np.array([splitmix64_uniform_reference(s, p, case) for s, p in zip(seeds, positions)])
    np.testing.assert_array_equal(sample_uniforms(seeds, positions, case), reference)
    from_torch = torch_sample_uniforms(seeds_to_int64(seeds), torch.tensor(positions), case)
    assert from_torch.dtype == torch.float64
    np.testing.assert_array_equal(from_torch.numpy(), reference)


def test_verify_numpy_and_torch_match_reference():
    seeds, positions = random_seeds_and_positions(2000, rng_seed=7)
    reference = np.array([splitmix64_uniform_reference(s, p, 2) for s, p in zip(seeds, positions)])
    np.testing.assert_array_equal(verify_uniforms(seeds, positions), reference)
    np.testing.assert_array_equal(torch_verify_uniforms(seeds_to_int64(seeds), torch.tensor(positions)).numpy(),
                                  reference)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_torch_on_cuda_matches_reference():
    seeds, positions = random_seeds_and_positions(2000, rng_seed=3)
    reference = np.array([splitmix64_uniform_reference(s, p, 0) for s, p in zip(seeds, positions)])
    on_gpu = torch_sample_uniforms(seeds_to_int64(seeds).cuda(), torch.tensor(positions).cuda())
    np.testing.assert_array_equal(on_gpu.cpu().numpy(), reference)


def test_negative_seed_equals_its_64_bit_pattern():
    np.testing.assert_array_equal(sample_uniforms([-1, -5], [9, 9]), sample_uniforms([U64, U64 - 4], [9, 9]))
    as_int64_array = np.array([-1, -5], dtype=np.int64)
    np.testing.assert_array_equal(sample_uniforms(as_int64_array, [9, 9]), sample_uniforms([U64, U64 - 4], [9, 9]))


def test_scalars_and_broadcasting():
    assert float(sample_uniforms(5, 3)) == splitmix64_uniform_reference(5, 3)
    np.testing.assert_array_equal(sample_uniforms(5, [1, 2]),
                                  [splitmix64_uniform_reference(5, 1), splitmix64_uniform_reference(5, 2)])


def test_streams_differ():
    # The three uses of one (seed, position) must be independent draws, not the same number.
    seeds, positions = random_seeds_and_positions(500)
    sample, residual, verify = (sample_uniforms(seeds, positions, 0), sample_uniforms(seeds, positions, 1),
                                verify_uniforms(seeds, positions))
    assert not np.any(sample == residual) and not np.any(sample == verify) and not np.any(residual == verify)


def test_bad_case_rejected():
    with pytest.raises(ValueError, match="case"):
        sample_uniforms([1], [1], case=2)


def test_in_unit_interval():
    seeds, positions = random_seeds_and_positions(5000, rng_seed=11)
    for u in (sample_uniforms(seeds, positions, 0), sample_uniforms(seeds, positions, 1),
              verify_uniforms(seeds, positions)):
        assert u.dtype == np.float64 and np.all(u >= 0.0) and np.all(u < 1.0)


def chi_square(u: np.ndarray, bins: int) -> float:
    counts = np.bincount(np.minimum((u * bins).astype(np.int64), bins - 1), minlength=bins)
    expected = len(u) / bins
    return float(((counts - expected) ** 2 / expected).sum())


# 20 bins -> 19 degrees of freedom; 43.8 is the 0.999 quantile. The values are deterministic, so this is a
# fixed sanity check of the mixing, not a flaky statistical test.
@pytest.mark.parametrize("name, draws", [
    ("consecutive positions, one seed", lambda: sample_uniforms(np.full(50_000, 1234, np.uint64),
                                                               np.arange(50_000, dtype=np.uint64))),
    ("consecutive seeds, one position", lambda: sample_uniforms(np.arange(50_000, dtype=np.uint64), 17)),
    ("residual case", lambda: sample_uniforms(7, np.arange(50_000, dtype=np.uint64), 1)),
    ("verify", lambda: verify_uniforms(np.arange(50_000, dtype=np.uint64), 5)),
])
def test_roughly_uniform(name, draws):
    u = draws()
    assert chi_square(u, 20) < 43.8, name
    assert abs(u.mean() - 0.5) < 0.01, name
