"""tests/engine/near_tie.py: where two greedy runs part, only a near tie of the reference's scores excuses it."""

from deepserve.outputs import Logprob

from tests.engine.near_tie import NEAR_TIE_NATS, first_divergence_is_a_near_tie


def top2(a: int, la: float, b: int, lb: float) -> dict:
    return {a: Logprob(la, 1), b: Logprob(lb, 2)}


def test_equal_runs_pass_and_unequal_lengths_fail():
    assert first_divergence_is_a_near_tie([1, 2, 3], [1, 2, 3], [])
    assert not first_divergence_is_a_near_tie([1, 2, 3], [1, 2], [])


def test_a_parting_is_excused_only_by_a_near_tie_at_its_first_position():
    logprobs = [top2(1, -0.1, 9, -3.0), top2(2, -0.70, 7, -0.70 - NEAR_TIE_NATS / 2)]
    assert first_divergence_is_a_near_tie([1, 2, 5], [1, 7, 8], logprobs)          # parts at a near tie
    far = [logprobs[0], top2(2, -0.1, 7, -0.1 - 2 * NEAR_TIE_NATS)]
    assert not first_divergence_is_a_near_tie([1, 2, 5], [1, 7, 8], far)          # a clear choice
    assert not first_divergence_is_a_near_tie([1, 2, 5], [1, 4, 8], logprobs)     # not in the top 2
    assert not first_divergence_is_a_near_tie([1, 2, 5], [9, 2, 5], logprobs)     # parts where it was clear
