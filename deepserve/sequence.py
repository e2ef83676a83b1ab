"""A Sequence is one stream of tokens being generated: a request with n=2 owns two of them.

Lifecycle:  WAITING --schedule--> RUNNING --stop/length/abort--> FINISHED_*
                ^                    |
                +----- preempt ------+   (KV dropped; recomputed from its tokens when resumed)

Invariants the scheduler keeps:
- `num_computed_tokens <= num_tokens`; the KV of tokens [0, num_computed_tokens) is in `block_table`.
- a WAITING sequence holds no blocks; a FINISHED one holds none either.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH_CAPPED = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_IGNORED = "ignored"    # can never be served (e.g. needs more KV than the whole cache)
    # Structured outputs could not continue: the grammar rejected the sampled token, its matcher failed, or it
    # did not compile in time. Never reported as "stop": the text does not match the grammar.
    FINISHED_SO_FAILED = "structured_output_failed"

    @property
    def is_finished(self) -> bool:
        return self not in _UNFINISHED

    @property
    def finish_reason(self) -> str | None:
        if not self.is_finished:
            return None
        return "length" if self is SequenceStatus.FINISHED_IGNORED else self.value


# Reading a member off an Enum class goes through its metaclass (~90 ns on CPython 3.11): the status checks made for
# every sequence at every step compare against these module-level names instead.
_UNFINISHED = (SequenceStatus.WAITING, SequenceStatus.RUNNING)


class Sequence:
    def __init__(self, seq_id: int, request_id: str, index: int, prompt_token_ids: list[int],
                 params: "SamplingParams", seed: int, arrival_time: float | None = None) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index                          # position among the request's n outputs
        self.token_ids = list(prompt_token_ids)     # prompt + generated tokens known on the host (never drafts)
        # Tokens sampled by a step still running on the device (overlapped scheduling): they count in
        # num_tokens, so the next step is scheduled as if they were known; their ids arrive one step later.
        self.num_inflight = 0
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.seed = seed                            # sampling randomness = f(seed, position)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        # Models with a window pool (engine/block_manager.py): the window block of each block, -1 once released (a
        # prefix of the table, num_window_released entries long).
        self.window_table: list[int] = []
        self.num_window_released = 0
        # The first position whose window states every layer wrote (YOCO's prompt steps skip consumer-layer rows
        # before a sequence's kept suffix): window blocks before it are never named for the prefix cache.
        self.window_complete_from = 0
        self.num_cached_tokens = 0                  # prefix-cache hit of the first admission
        self.num_preemptions = 0
        # Speculative decoding: tokens proposed for the positions after the last one, for the next step only (set by
        # the speculator before scheduling; never part of token_ids unless the target model accepts them).
        self.draft_token_ids: list[int] = []
        # With a grammar: the token bitmask of each verification row (structured/bitmask.py), [drafts + 1, words].
        self.draft_bitmask = None
        # A drafter that samples its drafts (DSpark, sampled requests): the distribution each draft was drawn from,
        # [drafts, vocab] (the verifier's Q); None: the drafts are point masses.
        self.draft_probs = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        # Structured outputs: the sequence's StructuredMatcher (deepserve/structured/matcher.py), set by the engine
        # once its grammar compiled; advanced per emitted token, it fills the sampler's bitmask row.
        self.grammar = None

    # --- sizes -------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_inflight

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status not in _UNFINISHED      # SequenceStatus.is_finished without its property call

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def resolve_inflight_token(self, token_id: int) -> None:
        """The device reported the token of an earlier overlapped step."""
        assert self.num_inflight > 0
        self.num_inflight -= 1
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id}, status={self.status.name}, "
                f"tokens={self.num_tokens}, inflight={self.num_inflight}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_table)})")
