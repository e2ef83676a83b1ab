"""StructuredMatcher: one sequence's position in its grammar.

    fill_bitmask(bitmask, row)          row = the tokens allowed next
    accept(token) -> bool               advance over one emitted token; False (state unchanged) if not allowed
    rollback(n)                         undo the last n accepted tokens (at most `rollback_capacity`)
    fill_bitmask_for_drafts(drafts)     speculative decoding: mask rows for the verify rows of a draft run
    is_terminated                       the grammar accepted its stop token (EOS): the sequence is done

Phases (so_args triggers, deepinfer.md §10): free (every token allowed, the trigger scanner watches) ->
forcing (after the bound token: the rest of the trigger, one token a step) -> grammar -> terminated (every
token allowed: only drafts past the end would read that mask). Without a trigger a matcher starts in grammar.

Invariants: a rejected token changes nothing (xgrammar's accept_token leaves the state as it was), so a caller
may probe drafts; each accepted token pushes one history entry (the trigger state before it and whether the
grammar consumed it), which is what `rollback` pops. Methods never raise on a grammar's behalf: an xgrammar
exception marks the matcher failed (`error` says why) and `accept` then refuses everything, which ends that
sequence alone with FINISHED_SO_FAILED.
"""

from __future__ import annotations

from collections import deque

import torch

from deepserve.structured import bitmask as bm
from deepserve.structured.trigger import TriggerScanner

DEFAULT_ROLLBACK_CAPACITY = 8       # >= speculative tokens + 2 (deepinfer.md §10)


class StructuredMatcher:
    def __init__(self, compiled_grammar, vocab_size: int, trigger_token_ids: tuple[int, ...] = (),
                 bound_token_id: int | None = None, rollback_capacity: int = DEFAULT_ROLLBACK_CAPACITY) -> None:
        import xgrammar as xgr
        bad = [t for t in (*trigger_token_ids, *([bound_token_id] if bound_token_id is not None else []))
               if t >= vocab_size]
        if bad:
            raise ValueError(f"so_args: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        self.vocab_size = vocab_size
        self.rollback_capacity = rollback_capacity
        # xgrammar keeps unlimited rollback history itself; the capacity is enforced by `_history`.
        self._matcher = xgr.GrammarMatcher(compiled_grammar)
        self._trigger = TriggerScanner(trigger_token_ids, bound_token_id) if trigger_token_ids else None
        self._history: deque[tuple[tuple[int, bool] | None, bool]] = deque(maxlen=rollback_capacity)
        self.num_accepted = 0
        self.error: str | None = None

    # --- state ---------------------------------------------------------------------------------
    @property
    def in_grammar(self) -> bool:
        return self._trigger is None or self._trigger.done

    @property
    def is_terminated(self) -> bool:
        return self.in_grammar and self._matcher.is_terminated()

    @property
    def failed(self) -> bool:
        return self.error is not None

    # --- one step ------------------------------------------------------------------------------
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (a CPU int32 [rows, ceil(V/32)] tensor)."""
        if self.failed or (self.in_grammar and self._matcher.is_terminated()):
            bitmask[row] = bm.ALL_ALLOWED
        elif not self.in_grammar:
            forced = self._trigger.forced_token
            if forced is None:
                bitmask[row] = bm.ALL_ALLOWED
            else:
                bm.allow_only(bitmask, row, forced)
        else:
            try:
                self._matcher.fill_next_token_bitmask(bitmask, row)
            except Exception as e:  # noqa: BLE001 - any matcher failure ends this sequence only
                self._fail(e)
                bitmask[row] = bm.ALL_ALLOWED

    def accept(self, token: int) -> bool:
        """Advance over `token`; False, changing nothing, if the grammar (or a forced trigger) does not allow it."""
        if self.failed:
            return False
        if not self.in_grammar:
            before = self._trigger.snapshot()
            if not self._trigger.feed(token):
                return False
            self._push(before, False)
            return True
        if self._matcher.is_terminated():
            self._push(None, False)         # past the end: free (only drafts can get here)
            return True
        try:
            ok = self._matcher.accept_token(token)
        except Exception as e:  # noqa: BLE001
            self._fail(e)
            return False
        if ok:
            self._push(None, True)
        return ok

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens."""
        if n < 0 or n > len(self._history):
            raise ValueError(f"cannot roll back {n} tokens: {len(self._history)} can be "
                             f"(rollback capacity {self.rollback_capacity})")
        in_grammar, trigger_state = 0, None
        for _ in range(n):
            state, fed_grammar = self._history.pop()
            in_grammar += fed_grammar
            trigger_state = state if state is not None else trigger_state
        if in_grammar:
            self._matcher.rollback(in_grammar)
        if trigger_state is not None:
            self._trigger.restore(trigger_state)
        self.num_accepted -= n

    # --- speculative decoding ------------------------------------------------------------------
    def fill_bitmask_for_drafts(self, drafts: list[int], bitmask: torch.Tensor | None = None,
                                first_row: int = 0) -> tuple[torch.Tensor, int]:
        """Mask rows for a verification run of `drafts` (deepinfer.md §10's per-step algorithm).

        Row first_row + k holds the tokens allowed after the committed tokens and drafts[:k]. Drafts are
        accepted tentatively one by one, a row filled after each; the first draft the grammar rejects stops
        it (its own row still masks it out, so verification rejects it there), and the later rows allow
        everything (never read: verification stops at that row). The matcher is rolled back to where it was.
        Returns (bitmask, number of drafts the grammar accepts); `bitmask` is allocated when not given,
        with len(drafts) + 1 rows.
        """
        if bitmask is None:
            bitmask = bm.allocate(len(drafts) + 1, self.vocab_size)
        self.fill_bitmask(bitmask, first_row)
        accepted = 0
        for k, token in enumerate(drafts, start=1):
            if accepted == self.rollback_capacity or not self.accept(token):
                break
            accepted += 1
            self.fill_bitmask(bitmask, first_row + k)
        for k in range(accepted + 1, len(drafts) + 1):
            bitmask[first_row + k] = bm.ALL_ALLOWED
        self.rollback(accepted)
        return bitmask, accepted

    # --- helpers -------------------------------------------------------------------------------
    def _push(self, trigger_state: tuple[int, bool] | None, fed_grammar: bool) -> None:
        self._history.append((trigger_state, fed_grammar))
        self.num_accepted += 1

    def _fail(self, error: Exception) -> None:
        self.error = f"structured outputs: the grammar matcher failed: {error}"
