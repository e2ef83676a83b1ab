"""so_args triggers (deepinfer.md §10): tokens are free until the trigger token sequence appears, then the
grammar applies to the tokens after it. Found with KMP, one token at a time, so a partial match that fails
falls back to the longest prefix of the trigger that is still a suffix of the output (no rescanning).

If the bound token is sampled before the trigger completed, free text is over: the rest of the trigger (from
the match length after the bound token) is forced one token at a time, then the grammar.

State is two small ints (matched, forcing), so a snapshot is a tuple: the matcher keeps one per accepted
token to roll back drafts.
"""

from __future__ import annotations


class TriggerScanner:
    def __init__(self, trigger: tuple[int, ...], bound_token_id: int | None = None) -> None:
        assert trigger, "a trigger is a non-empty token sequence"
        self.trigger = tuple(trigger)
        self.bound_token_id = bound_token_id
        self._failure = _failure_table(self.trigger)
        self.matched = 0            # length of the trigger prefix that ends the output so far
        self.forcing = False        # the bound token was seen: the rest of the trigger is forced

    @property
    def done(self) -> bool:
        """The trigger appeared: the grammar applies from the next token on."""
        return self.matched == len(self.trigger)

    @property
    def forced_token(self) -> int | None:
        return self.trigger[self.matched] if self.forcing and not self.done else None

    def feed(self, token: int) -> bool:
        """Advance over one free (or forced) token; False if a forced token was not the one sampled."""
        assert not self.done
        if self.forcing:
            if token != self.trigger[self.matched]:
                return False
            self.matched += 1
            return True
        self.matched = self._step(self.matched, token)
        if token == self.bound_token_id and not self.done:
            self.forcing = True
        return True

    def snapshot(self) -> tuple[int, bool]:
        return self.matched, self.forcing

    def restore(self, state: tuple[int, bool]) -> None:
        self.matched, self.forcing = state

    def _step(self, matched: int, token: int) -> int:
        while matched and self.trigger[matched] != token:
            matched = self._failure[matched - 1]
        return matched + 1 if self.trigger[matched] == token else 0


def _failure_table(pattern: tuple[int, ...]) -> list[int]:
    """failure[i] = length of the longest proper prefix of pattern[:i+1] that is also its suffix."""
    failure = [0] * len(pattern)
    k = 0
    for i in range(1, len(pattern)):
        while k and pattern[i] != pattern[k]:
            k = failure[k - 1]
        if pattern[i] == pattern[k]:
            k += 1
        failure[i] = k
    return failure
