"""TriggerScanner: KMP over token ids finds the trigger exactly where a naive search of the output would."""

from __future__ import annotations

import random

from deepserve.structured.trigger import TriggerScanner


def first_occurrence_end(tokens: list[int], trigger: list[int]) -> int | None:
    for end in range(len(trigger), len(tokens) + 1):
        if tokens[end - len(trigger):end] == trigger:
            return end
    return None


def test_kmp_matches_a_naive_search_on_random_streams():
    rng = random.Random(0)
    for _ in range(500):
        trigger = [rng.randrange(3) for _ in range(rng.randrange(1, 5))]
        tokens = [rng.randrange(3) for _ in range(30)]
        scanner = TriggerScanner(tuple(trigger))
        found = None
        for i, t in enumerate(tokens):
            assert scanner.feed(t)
            if scanner.done:
                found = i + 1
                break
        assert found == first_occurrence_end(tokens, trigger), (trigger, tokens)


def test_overlapping_partial_match_falls_back():
    scanner = TriggerScanner((1, 1, 2))
    for t in (1, 1, 1):
        scanner.feed(t)
    assert scanner.matched == 2 and not scanner.done
    scanner.feed(2)
    assert scanner.done


def test_the_bound_token_forces_the_rest_of_the_trigger():
    scanner = TriggerScanner((10, 11, 12), bound_token_id=10)
    assert scanner.feed(5) and scanner.forced_token is None        # free
    assert scanner.feed(10) and scanner.forced_token == 11        # the bound token starts the trigger
    assert not scanner.feed(12)                                    # a forced token must be the one sampled
    assert scanner.snapshot() == (1, True)
    assert scanner.feed(11) and scanner.feed(12) and scanner.done
    other = TriggerScanner((10, 11), bound_token_id=99)            # a bound token outside the trigger
    other.feed(99)
    assert other.forced_token == 10
