"""Data-parallel attention's step-type decision (deepinfer.md §4.2): when the DP ranks take a prompt step.

With attention data-parallel, every rank is an engine of its own (scheduler, KV cache, requests), but the MoE
layers' collectives need every rank in the same kind of step at the same time. A NORMAL engine therefore never
mixes prompts and decodes in one step, and decides the step type with votes that every rank casts in the same
order, so that no rank waits in a collective the others never enter:

    any_point = decode_step != 0 and decode_step % ANY_INTERVAL == 0      (ANY_INTERVAL = 100)
    all_point = decode_step % ALL_INTERVAL == 0                            (ALL_INTERVAL = 70)
    neither -> decode
    want    = the rank could start a prompt (KV usage <= 0.9, a schedulable prompt at the head of `waiting`)
    vote 1  = ANY at an any point (one wanting rank suffices), else ALL (every rank must want)
    not vote 1 -> decode
    out     = schedule_prefill() if want else nothing
    vote 2  = did any rank actually schedule a prompt?      (no: decode; stops a livelock where all wanted, none could)
    prompt step: `out`, or an empty prompt step (a placeholder forward, so the collectives still match)

`decode_step` counts decode steps since the last prompt step (a prompt step resets it to 0), identically on every
rank, because every rank takes every step: the points above are the same everywhere, and so is the number and
order of collectives each rank enters. Invariant (tested with gloo processes): every rank returns the same step
kind at every step.

The collective is a parameter (`allreduce_min`), so the policy is a plain function a test can drive with one rank
(the identity) or with real torch.distributed groups (`gloo_allreduce_min`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

ANY_INTERVAL = 100
ALL_INTERVAL = 70
KV_USAGE_LIMIT = 0.9

T = TypeVar("T")


class StepKind(enum.Enum):
    DECODE = "decode"
    PROMPT = "prompt"           # possibly empty on this rank: a placeholder forward


@dataclass
class StepDecision(Generic[T]):
    kind: StepKind
    prompts: T | None = None    # what schedule_prefill returned on this rank (None: empty prompt step or decode)


class StepVote:
    """One rank's side of the votes; `decode_step` is the counter every rank keeps in step."""

    def __init__(self, allreduce_min: Callable[[int], int]) -> None:
        self.allreduce_min = allreduce_min
        self.decode_step = 0

    def decide(self, want_prompt: bool, schedule_prefill: Callable[[], T | None]) -> StepDecision[T]:
        decision = self._decide(want_prompt, schedule_prefill)
        self.decode_step = 0 if decision.kind is StepKind.PROMPT else self.decode_step + 1
        return decision

    def _decide(self, want: bool, schedule_prefill: Callable[[], T | None]) -> StepDecision[T]:
        any_point = self.decode_step != 0 and self.decode_step % ANY_INTERVAL == 0
        all_point = self.decode_step % ALL_INTERVAL == 0
        if not (any_point or all_point):
            return StepDecision(StepKind.DECODE)
        if any_point:           # any point wins when both coincide
            agreed = self.allreduce_min(0 if want else 1) == 0
        else:
            agreed = self.allreduce_min(1 if want else 0) == 1
        if not agreed:
            return StepDecision(StepKind.DECODE)
        out = schedule_prefill() if want else None
        if self.allreduce_min(0 if out else 1) != 0:
            return StepDecision(StepKind.DECODE)
        return StepDecision(StepKind.PROMPT, out or None)


def wants_prompt(kv_usage: float, head_schedulable: bool) -> bool:
    """A rank wants a prompt step when its cache has room and the head of its waiting queue can be scheduled."""
    return kv_usage <= KV_USAGE_LIMIT and head_schedulable


def gloo_allreduce_min(group=None) -> Callable[[int], int]:
    """An allreduce_min over a torch.distributed group (the DP group; gloo on CPUs)."""
    import torch
    import torch.distributed as dist

    def allreduce_min(value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        return int(t.item())
    return allreduce_min
