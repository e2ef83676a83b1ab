"""What a drafter proposes for one sequence, and the protocol every drafter follows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from deepserve.sequence import Sequence


@dataclass
class Drafts:
    """Draft tokens for the positions after a sequence's last token, in order.

    confidences[i]: the drafter's estimate that draft i is accepted given drafts 0..i-1 were (the verification-length
    policy multiplies them into cumulative acceptance). A drafter whose draft is a single token, not a distribution
    (prompt lookup), proposes with probability 1: the verifier then accepts draft i with the target's probability of it.
    """
    token_ids: list[int] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    match_length: int = 0           # n-gram drafters: the length of the suffix that matched (keys the estimate)
    seq_id: int = -1                # whose drafts (drafters that keep per-sequence state read it back)
    # [len, vocab]: the distribution each draft was drawn from (a sampling drafter); None: point masses.
    probs: object = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def truncated(self, n: int) -> "Drafts":
        probs = None if self.probs is None or n == 0 else self.probs[:n]
        return Drafts(self.token_ids[:n], self.confidences[:n], self.match_length, self.seq_id, probs)


class ScheduledRows(Protocol):
    """What a model drafter reads of one scheduled sequence in a step: the fields of the worker's
    ScheduledSequence (worker/scheduler_output.py), stated here because the worker imports this floor, not the
    other way round."""
    seq: Sequence
    start: int              # first position computed in the step
    num_new_tokens: int     # positions [start, start + num_new_tokens) are computed
    samples: bool           # the step samples this sequence's next token


class Drafter(Protocol):
    def propose(self, seq: Sequence, max_drafts: int) -> Drafts:
        """Up to `max_drafts` drafts following `seq`'s known tokens (none is a valid answer)."""

    def observe(self, drafts: Drafts, num_verified: int, num_accepted: int) -> None:
        """The target verified the first `num_verified` of `drafts` and accepted `num_accepted` of them."""

    def forget(self, seq: Sequence) -> None:
        """`seq` is gone: drop what was kept for it."""


class ModelDrafter:
    """Serves drafts a model made inside the step before (the MTP layer's, the DSpark blocks'): the runner hands them
    over after each step (`latest`, by seq_id), each made for the sequence at one length. Subclasses say how a
    model's draft reads as tokens and confidences."""

    def __init__(self) -> None:
        self.latest: dict = {}

    def propose(self, seq: Sequence, max_drafts: int) -> Drafts:
        draft = self.latest.pop(seq.seq_id, None)
        if draft is None or max_drafts < 1 or draft.position != seq.num_tokens:
            return Drafts()             # none, or made for another length (the sequence was preempted since)
        tokens, confidences = self.tokens_and_confidences(draft)
        probs = self.distributions(draft)
        return Drafts(tokens[:max_drafts], confidences[:max_drafts], 0, seq.seq_id,
                      None if probs is None else probs[:max_drafts])

    def tokens_and_confidences(self, draft) -> tuple[list[int], list[float]]:
        raise NotImplementedError

    def distributions(self, draft):
        """[drafts, vocab] the draws' distributions when the model sampled its drafts; None: point masses."""
        return None

    def observe(self, drafts: Drafts, num_verified: int, num_accepted: int) -> None:
        pass                            # the model's own confidences need no estimate

    def step(self) -> None:
        pass

    def forget(self, seq: Sequence) -> None:
        self.latest.pop(seq.seq_id, None)

