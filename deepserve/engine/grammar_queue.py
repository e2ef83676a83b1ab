"""GrammarQueue: structured-output sequences whose grammar is still compiling.

A structured request is checked (its grammar parses) in add_request, then its compile starts in the
compiler's thread pool and its sequences wait here, outside the scheduler: other requests keep decoding.
Every engine step polls the queue (`take_ready`): a compiled sequence gets its StructuredMatcher and joins
the scheduler's waiting queue; one whose compile failed, whose matcher could not be built, or that waited
longer than DEEPSERVE_SO_COMPILE_TIMEOUT seconds comes back as failed with its `error` set.

Invariant: a sequence is in exactly one of this queue and the scheduler; a queued one holds no KV blocks.
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from deepserve import envs
from deepserve.sequence import Sequence
from deepserve.structured.matcher import StructuredMatcher
from deepserve.structured.spec import GrammarSpec


@dataclass
class _Pending:
    seq: Sequence
    spec: GrammarSpec
    future: Future
    deadline: float


class GrammarQueue:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._pending: list[_Pending] = []

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, seqs: list[Sequence], spec: GrammarSpec, future: Future) -> None:
        deadline = time.monotonic() + envs.DEEPSERVE_SO_COMPILE_TIMEOUT
        self._pending += [_Pending(seq, spec, future, deadline) for seq in seqs]

    def remove(self, seq: Sequence) -> bool:
        """Forget `seq` (its request was aborted); False if it was not waiting here."""
        kept = [p for p in self._pending if p.seq is not seq]
        found = len(kept) < len(self._pending)
        self._pending = kept
        return found

    def take_ready(self, now: float | None = None) -> tuple[list[Sequence], list[Sequence]]:
        """(sequences ready to schedule, with their matcher set; sequences that failed, with `error` set)."""
        now = time.monotonic() if now is None else now
        ready, failed, waiting = [], [], []
        for p in self._pending:
            if p.future.done():
                (ready if self._attach_matcher(p) else failed).append(p.seq)
            elif now >= p.deadline:
                p.seq.error = (f"structured outputs: the grammar did not compile within "
                               f"{envs.DEEPSERVE_SO_COMPILE_TIMEOUT} s (DEEPSERVE_SO_COMPILE_TIMEOUT)")
                failed.append(p.seq)
            else:
                waiting.append(p)
        self._pending = waiting
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block until a compile finishes, the nearest deadline passes, or `timeout` (the engine has nothing else
        to do: spinning would take the CPU from the compile threads)."""
        if not self._pending:
            return
        nearest = min(p.deadline for p in self._pending) - time.monotonic()
        wait([p.future for p in self._pending], timeout=max(0.0, min(timeout, nearest)), return_when=FIRST_COMPLETED)

    def _attach_matcher(self, p: _Pending) -> bool:
        error = p.future.exception()
        if error is not None:
            p.seq.error = str(error)
            return False
        try:
            p.seq.grammar = StructuredMatcher(p.future.result(), self.vocab_size, p.spec.trigger_token_ids,
                                              p.spec.bound_token_id)
        except Exception as e:  # noqa: BLE001 - a bad trigger or an xgrammar failure ends this request only
            p.seq.error = str(e) if isinstance(e, ValueError) else f"structured outputs: {e}"
            return False
        return True
