"""Prompt lookup: the latest earlier occurrence of the longest matching suffix, kept incrementally."""

from __future__ import annotations

import random

from deepserve.sampling_params import SamplingParams
from deepserve.sequence import Sequence
from deepserve.spec_decode.ngram import MatchLengthAcceptance, NgramDrafter


def make_seq(tokens: list[int], seq_id: int = 1) -> Sequence:
    return Sequence(seq_id, "r", 0, tokens, SamplingParams(), seed=0)


def brute_force(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):       # latest earlier occurrence first
            if tokens[end - n:end] == suffix:
                return tokens[end:end + k]
    return []


def test_proposes_what_followed_the_suffix_last_time():
    drafter = NgramDrafter(3, 1, 3)
    seq = make_seq([5, 6, 7, 8, 9, 1, 5, 6, 7])
    drafts = drafter.propose(seq, 3)
    assert drafts.token_ids == [8, 9, 1]
    assert drafts.match_length == 3
    assert len(drafts.confidences) == 3


def test_no_match_no_drafts_and_the_limit_holds():
    drafter = NgramDrafter(4, 2, 3)
    assert drafter.propose(make_seq([1, 2, 3, 4]), 4).token_ids == []
    assert drafter.propose(make_seq([1, 2, 3, 1, 2], seq_id=2), 1).token_ids == [3]


def test_incremental_index_matches_a_brute_force_search_as_the_sequence_grows():
    rng = random.Random(0)
    for trial in range(20):
        tokens = [rng.randrange(6) for _ in range(8)]
        seq = make_seq(tokens, seq_id=trial)
        drafter = NgramDrafter(4, 1, 3)
        for _ in range(40):
            assert drafter.propose(seq, 4).token_ids == brute_force(seq.token_ids, 1, 3, 4)
            for _ in range(rng.randrange(1, 4)):     # several tokens may arrive between proposals (accepted drafts)
                seq.append_token(rng.randrange(6))


def test_acceptance_estimate_learns_and_forgets():
    est = MatchLengthAcceptance(max_drafts=3, max_match=2, decay=0.5)
    prior = est.rates(2, False, 3)
    assert prior == [2 / 3] * 3
    for _ in range(20):
        est.observe(2, False, num_verified=3, num_accepted=0)    # draft 0 always rejected, later ones never judged
    rates = est.rates(2, False, 3)
    assert rates[0] < 0.15 and rates[1:] == prior[1:]
    assert est.rates(2, True, 3) == prior                      # the streak estimate is kept apart
    for _ in range(30):
        est.step()
    assert est.rates(2, False, 1)[0] > 0.6                      # old evidence fades back to the prior
