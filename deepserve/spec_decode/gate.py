"""Speculate only while it pays: the engine-level check of verify_length="confidence".

The verification-length policy prices one step: which drafts are worth their rows under the measured step-cost
curve. It cannot see what speculating costs the loop around the step: drafts are proposed from known tokens, so a
speculating engine cannot schedule step n+1 while step n runs (no overlapped scheduling), and proposing and
verifying take host time. Where the device step is cheap (small models, large batches) that can cost more than the
accepted drafts save, so confidence-scheduled speculation could still lose to no speculation at all.

The gate measures instead of predicting: output tokens per second of the engine loop (wall time between step
ends, each step's emitted tokens), with speculation on and off (off: no drafts, and the engine overlaps its steps
when it can), and keeps the faster mode for an exploit period, then probes the other one again (loads change):

    speculate (FIRST_STEPS) -> probe off (PROBE_STEPS) -> exploit the faster (L) -> probe the other
    -> exploit the faster (L) -> ...

An exploit period lasts MIN_EXPLOIT_STEPS after a switch of winner and doubles (up to MAX_EXPLOIT_STEPS) each time
the same mode wins again: a load where one mode is clearly better is probed rarely, and a wrong first guess costs a
few dozen steps, not hundreds (at a small model's step of a millisecond, a batch lasts a few hundred steps).

It starts by speculating (what the user asked for) for FIRST_STEPS: a short run, e.g. one request of a hundred
tokens, is never made to decode without drafts just to measure.

A/B by adjacent windows: a probe is compared with the last PROBE_STEPS steps of the exploit period just before it,
not with an average over the run, because a batch's composition drifts (requests finish, so later steps carry fewer
sequences and fewer tokens). Only decode-only steps count (a step that also computes prompt tokens says nothing of
decoding speed), and not the first SETTLE_STEPS after a switch (the switch drains or refills the pipeline).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

PROBE_STEPS = 16
FIRST_STEPS = 64
MIN_EXPLOIT_STEPS = 32
MAX_EXPLOIT_STEPS = 512
SETTLE_STEPS = 2


@dataclass
class _Phase:
    speculating: bool
    probing: bool               # a probe (measure the mode), or an exploit period (keep the faster one)
    steps: int                  # steps it lasts
    counted_tokens: int = 0
    counted_seconds: float = 0.0
    done: int = 0


class SpeculationGate:
    def __init__(self, probe_steps: int = PROBE_STEPS, first_steps: int = FIRST_STEPS,
                 min_exploit_steps: int = MIN_EXPLOIT_STEPS, max_exploit_steps: int = MAX_EXPLOIT_STEPS,
                 settle_steps: int = SETTLE_STEPS, clock=time.perf_counter) -> None:
        if not probe_steps <= min(first_steps, min_exploit_steps) <= max_exploit_steps:
            raise ValueError("the gate needs probe_steps <= first_steps, min_exploit_steps <= max_exploit_steps")
        self.probe_steps, self.settle_steps = probe_steps, settle_steps
        self.min_exploit_steps, self.max_exploit_steps = min_exploit_steps, max_exploit_steps
        self.clock = clock
        self.rates: dict[bool, float | None] = {True: None, False: None}   # tokens / s, speculating or not
        self.num_switches = 0
        self._winner: bool | None = None        # the mode the last exploit period kept
        self._exploit_steps = min_exploit_steps
        self._phase = _Phase(True, False, first_steps)
        self._last_end: float | None = None

    @property
    def speculating(self) -> bool:
        """Whether the next step speculates."""
        return self._phase.speculating

    def step_done(self, emitted_tokens: int, decoding: bool) -> None:
        """After every engine step: the output tokens it emitted and whether it was a decode-only step."""
        now = self.clock()
        phase = self._phase
        # Probes count after settling; exploit periods only their last probe_steps (the window before the next probe).
        start = self.settle_steps if phase.probing else phase.steps - self.probe_steps
        if self._last_end is not None and decoding and phase.done >= start:
            phase.counted_tokens += emitted_tokens
            phase.counted_seconds += now - self._last_end
        self._last_end = now
        phase.done += 1
        if phase.done >= phase.steps:
            self._next_phase()

    def _next_phase(self) -> None:
        ended = self._phase
        self.rates[ended.speculating] = (ended.counted_tokens / ended.counted_seconds if ended.counted_seconds > 0
                                         else None)
        on, off = self.rates[True], self.rates[False]
        if not ended.probing:                   # an exploit period ended: probe the other mode (loads change)
            mode, probing = not ended.speculating, True
        elif on is None or off is None:         # a probe measured nothing (no decodes in it): probe what is missing
            mode, probing = on is None, True
        else:                                   # both measured: exploit the faster, longer if it won last time too
            mode, probing = on >= off, False
            self._exploit_steps = (min(2 * self._exploit_steps, self.max_exploit_steps) if mode == self._winner
                                   else self.min_exploit_steps)
            self._winner = mode
        if mode != ended.speculating:
            self.num_switches += 1
        self._phase = _Phase(mode, probing, self.probe_steps if probing else self._exploit_steps)


__all__ = ["SpeculationGate"]
