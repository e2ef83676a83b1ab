"""Prompt-lookup drafting: if the sequence's last n tokens occurred before, propose what followed them then.

Copy-heavy work (editing a document, repeating code, answering with quotes of the prompt) repeats long runs of
tokens; a run that started repeating is likely to go on. Suffixes of `prompt_lookup_max` down to `prompt_lookup_min`
tokens are tried, longest first, and the most recent earlier occurrence wins.

Each sequence keeps an index {n-gram -> end of its latest occurrence} that grows with the sequence (a token list
only ever grows), so a step costs O(new tokens) per sequence, not a scan of the whole context.

Confidence: the draft is a token, not a distribution, so its confidence is an online estimate: the acceptance rate
of draft i after a match of length n, over recent verifications (`MatchLengthAcceptance`).
"""

from __future__ import annotations

from deepserve.sequence import Sequence
from deepserve.spec_decode.drafts import Drafts


class MatchLengthAcceptance:
    """P(draft i accepted | drafts before it accepted, match length n, streak), from counts that decay every step.

    `streak`: the sequence's previous verification accepted every draft it verified. Acceptance is strongly
    correlated along a sequence (a copy, once it starts, goes on; free text rarely repeats), so the estimate is kept
    apart for sequences in a streak and the others. The Beta(2, 1) prior (2/3 before any evidence) is optimistic on
    purpose: a draft never verified is never learnt from. Counts decay by `decay` per engine step, so a key judged
    worthless drifts back to the prior once its evidence is old and is tried again (a rate near 0 would otherwise
    never be verified and never recover when the text turns repetitive)."""

    def __init__(self, max_drafts: int, max_match: int, decay: float = 0.995) -> None:
        self.decay = decay
        keys = [(n, streak) for n in range(max_match + 1) for streak in (False, True)]
        self.accepted = {key: [0.0] * max_drafts for key in keys}
        self.verified = {key: [0.0] * max_drafts for key in keys}

    def rates(self, match_length: int, streak: bool, n: int) -> list[float]:
        acc, ver = self.accepted[match_length, streak], self.verified[match_length, streak]
        return [(acc[i] + 2.0) / (ver[i] + 3.0) for i in range(n)]

    def observe(self, match_length: int, streak: bool, num_verified: int, num_accepted: int) -> None:
        """Drafts 0..num_accepted-1 were accepted; draft num_accepted (if verified) was rejected; later ones were
        never judged (they come after a rejection)."""
        acc, ver = self.accepted[match_length, streak], self.verified[match_length, streak]
        for i in range(min(num_accepted + 1, num_verified)):
            ver[i] += 1.0
            acc[i] += 1.0 if i < num_accepted else 0.0

    def step(self) -> None:
        d = self.decay
        for row in (*self.accepted.values(), *self.verified.values()):
            for i in range(len(row)):
                row[i] *= d


class _NgramIndex:
    """{n-gram of the sequence -> end (exclusive) of its latest occurrence}, for every n in [lo, hi], built up to
    but excluding the current suffix (the suffix is looked up before it is added)."""

    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi
        self.latest: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(lo, hi + 1)}
        self.indexed = 0      # ends < indexed are in the index

    def lookup(self, tokens: list[int]) -> tuple[int, int]:
        """(n, end of the latest earlier occurrence of the last n tokens) for the longest n that matched, or (0, -1).
        Indexes the ends it had not yet seen, the current one after the lookup."""
        length = len(tokens)
        for end in range(self.indexed, length):
            self._add(tokens, end)
        self.indexed = max(self.indexed, length)
        found = (0, -1)
        for n in range(min(self.hi, length - 1), self.lo - 1, -1):
            end = self.latest[n].get(tuple(tokens[length - n:]))
            if end is not None:
                found = (n, end)
                break
        self._add(tokens, length)
        self.indexed = length + 1
        return found

    def _add(self, tokens: list[int], end: int) -> None:
        for n in range(self.lo, min(self.hi, end) + 1):
            self.latest[n][tuple(tokens[end - n:end])] = end


class NgramDrafter:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.lo, self.hi = prompt_lookup_min, prompt_lookup_max
        self.acceptance = MatchLengthAcceptance(num_speculative_tokens, prompt_lookup_max)
        self._indexes: dict[int, _NgramIndex] = {}
        self._streak: dict[int, bool] = {}      # seq_id -> its last verification accepted all it verified

    def propose(self, seq: Sequence, max_drafts: int) -> Drafts:
        index = self._indexes.get(seq.seq_id)
        if index is None:
            index = self._indexes[seq.seq_id] = _NgramIndex(self.lo, self.hi)
        tokens = seq.token_ids
        n, end = index.lookup(tokens)
        count = min(self.k, max_drafts)
        if n == 0 or count <= 0:
            return Drafts()
        drafts = tokens[end:end + count]
        streak = self._streak.get(seq.seq_id, False)
        return Drafts(drafts, self.acceptance.rates(n, streak, len(drafts)), n, seq.seq_id)

    def observe(self, drafts: Drafts, num_verified: int, num_accepted: int) -> None:
        if not drafts.match_length or not num_verified:
            return
        streak = self._streak.get(drafts.seq_id, False)
        self.acceptance.observe(drafts.match_length, streak, num_verified, num_accepted)
        self._streak[drafts.seq_id] = num_accepted == num_verified

    def step(self) -> None:
        self.acceptance.step()

    def forget(self, seq: Sequence) -> None:
        self._indexes.pop(seq.seq_id, None)
        self._streak.pop(seq.seq_id, None)
