"""What the scheduler hands the worker for one step: which sequences, and which of their positions to compute.

The worker's input contract. It lives on the worker's floor so that the worker never imports the engine;
the engine's Scheduler builds it (engine/scheduler.py) and the ModelRunner executes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepserve.sequence import Sequence


@dataclass(slots=True)      # slots: one is built per scheduled sequence per step, and read several times
class ScheduledSequence:
    seq: Sequence
    start: int              # first position computed in this step
    num_new_tokens: int     # positions [start, start + num_new_tokens) are computed
    # Speculative decoding: the last len(draft_token_ids) of those positions hold these drafts, not known tokens;
    # the step verifies them and emits the accepted ones plus one more token.
    draft_token_ids: list[int] = field(default_factory=list)
    # The chunk reaches the sequence's last token, so this step samples the next one (fixed when scheduled:
    # the sequence grows while the step runs).
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_new_tokens - len(self.draft_token_ids) == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    ignored: list[Sequence] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    window_blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)    # the window pool's (block_manager)
    speculative: bool = False       # scheduled by a speculating engine (its decodes verify drafts, maybe none)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
