"""A circuit breaker per replica: stop sending to a replica whose requests keep failing, try it again later.

Health probes catch a replica that is down or hung; the breaker catches one that answers /health but fails
its requests (5xx, timeouts, connections cut), which would otherwise keep taking a share of the traffic and
fail it, dragging every client's error rate up.

States: closed (traffic flows) -> open after `failures` failed requests in a row (no traffic for the
cooldown) -> half-open when the cooldown is over (exactly one trial request) -> closed if the trial succeeds,
open again with the cooldown doubled (up to 16x) if it fails.
"""

from __future__ import annotations

import time
from collections.abc import Callable

_MAX_COOLDOWN_FACTOR = 16


class CircuitBreaker:
    def __init__(self, failures: int = 5, cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.failures = failures
        self.base_cooldown_s = cooldown_s
        self.clock = clock
        self.consecutive_failures = 0
        self.cooldown_s = cooldown_s
        self.opened_at: float | None = None       # None: closed
        self.trial_in_flight = False

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if self.clock() - self.opened_at >= self.cooldown_s else "open"

    def allows(self) -> bool:
        """May a request be sent now? (Does not take the half-open trial: `on_dispatch` does.)"""
        state = self.state
        return state == "closed" or (state == "half_open" and not self.trial_in_flight)

    def on_dispatch(self) -> None:
        if self.opened_at is not None:
            self.trial_in_flight = True

    def on_success(self) -> None:
        self.consecutive_failures = 0
        self.opened_at = None
        self.trial_in_flight = False
        self.cooldown_s = self.base_cooldown_s

    def on_failure(self) -> None:
        self.consecutive_failures += 1
        if self.opened_at is not None:
            if self.trial_in_flight:          # the trial failed: stay out longer
                self.cooldown_s = min(self.cooldown_s * 2, self.base_cooldown_s * _MAX_COOLDOWN_FACTOR)
                self.opened_at = self.clock()
            self.trial_in_flight = False
        elif self.consecutive_failures >= self.failures:
            self.opened_at = self.clock()
