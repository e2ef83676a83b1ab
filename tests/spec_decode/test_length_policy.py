"""The verification-length objective on hand-built cost curves and confidences (deepinfer.md §6.4)."""

from __future__ import annotations

import pytest

from deepserve.spec_decode.length_policy import StepCostModel, choose_verify_lengths, cumulative_acceptance


def linear(base: float, per_row: float, max_rows: int = 1024):
    return lambda g: base + per_row * g if g <= max_rows else None


def test_worthless_drafts_are_not_verified():
    conf = [[0.0] * 5, [0.01] * 5]
    assert choose_verify_lengths(conf, linear(10.0, 1.0)) == [0, 0]


def test_confident_drafts_on_nearly_free_rows_are_all_verified():
    conf = [[0.99] * 5, [0.95] * 5, [0.9] * 5]
    assert choose_verify_lengths(conf, linear(10.0, 0.001)) == [5, 5, 5]


def test_in_between_verifies_the_likely_prefix():
    # a = 0.9, 0.81, 0.73, 0.66, 0.59 for seq 0; seq 1's drafts are hopeless. A row costs half a 1-row step, so a
    # row pays while its a exceeds the tokens per ms reached so far: the first drafts do, later ones do not.
    conf = [[0.9] * 5, [0.05] * 5]
    lengths = choose_verify_lengths(conf, linear(1.0, 1.0))
    assert lengths[1] == 0
    assert 0 < lengths[0] < 5
    # Brute force over every split gives the same value (the greedy ranking is optimal: a never rises with j).
    cost = linear(1.0, 1.0)
    best = max(((2 + sum(cumulative_acceptance(conf[0])[:i]) + sum(cumulative_acceptance(conf[1])[:j]))
                / cost(2 + i + j), i, j) for i in range(6) for j in range(6))
    chosen = (2 + sum(cumulative_acceptance(conf[0])[:lengths[0]])) / cost(2 + lengths[0])
    assert chosen == pytest.approx(best[0])


def test_rows_beyond_the_curve_are_never_chosen():
    conf = [[1.0] * 8 for _ in range(4)]
    lengths = choose_verify_lengths(conf, linear(10.0, 0.0, max_rows=10))
    assert sum(lengths) + 4 <= 10


def test_ties_keep_the_smallest_t_and_lower_sequences_first():
    # One extra row doubles the tokens and costs double: equal value, so no draft; with a cheaper row, seq 0 first.
    assert choose_verify_lengths([[1.0], [1.0]], lambda g: float(g) if g <= 4 else None) == [0, 0]
    assert choose_verify_lengths([[0.5], [0.5]], lambda g: {2: 2.0, 3: 2.2, 4: 4.0}.get(g)) == [1, 0]


def test_no_sequences_and_sequences_without_drafts():
    assert choose_verify_lengths([], linear(1.0, 1.0)) == []
    assert choose_verify_lengths([[], []], linear(1.0, 0.0)) == [0, 0]


def test_cost_model_interpolates_pads_and_learns_an_online_slope():
    curve = [(1, 10.0), (4, 16.0), (8, 24.0)]
    eager = StepCostModel(curve)
    assert eager.cost(2) == pytest.approx(12.0)
    assert eager.cost(8) == pytest.approx(24.0)
    assert eager.cost(9) is None
    padded = StepCostModel(curve, padded=True)
    assert padded.cost(2) == pytest.approx(16.0)        # a 2-row step runs in the 4-row graph
    # Live steps 3 ms (host work) + 1 ms a row slower than the profile: after enough samples at two sizes the fit
    # says so; below the profile both clamp at 0.
    for _ in range(10):
        eager.observe(4, 16.0 + 3.0 + 4 * 1.0)
        eager.observe(8, 24.0 + 3.0 + 8 * 1.0)
    assert eager.slope == pytest.approx(1.0)
    assert eager.overhead == pytest.approx(3.0)
    assert eager.cost(2) == pytest.approx(12.0 + 3.0 + 2.0)
    # One size only: the excess is all overhead (a per-step cost does not make draft rows dearer).
    one = StepCostModel(curve)
    for _ in range(10):
        one.observe(4, 20.0)
    assert (one.slope, one.overhead) == (0.0, pytest.approx(4.0))
    fast = StepCostModel(curve, min_samples=2)
    fast.observe(4, 1.0)
    fast.observe(4, 1.0)
    assert fast.slope == 0.0 and fast.overhead == 0.0


def test_the_online_fit_is_redone_once_per_hundredth_of_the_window():
    """A full window of 5000 samples refits every 50 new ones (about 1.5 ms of Python each time, too much for every
    step of a sub-millisecond GPU step); the estimate still follows the samples."""
    curve = [(1, 10.0), (4, 16.0), (8, 24.0)]
    model = StepCostModel(curve)
    for _ in range(3000):
        model.observe(4, 16.0 + 3.0 + 4 * 1.0)
        model.observe(8, 24.0 + 3.0 + 8 * 1.0)
    assert model.num_fits < 700                       # every step: 6000 (about 100 ln(5000 / 100) + 100 while filling)
    assert model.slope == pytest.approx(1.0) and model.overhead == pytest.approx(3.0)
    for _ in range(3000):                             # the load changes: 2 ms a row now
        model.observe(4, 16.0 + 3.0 + 4 * 2.0)
        model.observe(8, 24.0 + 3.0 + 8 * 2.0)
    assert model.slope == pytest.approx(2.0) and model.overhead == pytest.approx(3.0)
