"""One replica as the router sees it: its URL, health, circuit breaker, load, and the attempts in flight there.

Load is counted at dispatch, on every path (sgl/vllm routers that counted only on some paths sent all traffic
to one replica, field.md §B.6b): `begin` when a request is sent, `end` (idempotent, in a `finally`) when its
answer is complete or abandoned. Each attempt's upstream I/O runs as a task the replica tracks, so that taking
the replica out (a hung replica found by the health probe) cancels them at once rather than leaving their
clients waiting for a read timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from deepserve.router.circuit_breaker import CircuitBreaker
from deepserve.router.load_report import LoadReport, recent_ttft_s

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ReplicaDown(Exception):
    """An attempt was cut because its replica was taken out (probe failures, refused connection)."""


@dataclass
class Dispatch:
    """The load one request puts on one replica, released exactly once."""
    replica: Replica
    tokens: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.replica.in_flight -= 1
            self.replica.in_flight_tokens -= self.tokens


class Replica:
    def __init__(self, url: str, breaker: CircuitBreaker) -> None:
        self.url = url
        self.breaker = breaker
        # Not routed to before the first good probe: a replica listed while it still loads its model would
        # otherwise refuse the first requests sent to it.
        self.healthy = False
        self.removed = False                      # dropped from the set: drains, gets nothing new
        self.failed_probes = 0
        self.in_flight = 0
        self.in_flight_tokens = 0
        self.report: LoadReport | None = None
        self.recent_ttft_s: float | None = None
        self.last_change = time.monotonic()
        self._attempts: set[asyncio.Future] = set()

    def __repr__(self) -> str:
        return f"Replica({self.url}, healthy={self.healthy}, in_flight={self.in_flight})"

    # --- load ------------------------------------------------------------------------------------
    @property
    def load(self) -> float:
        """Requests on the replica: the router's own count or the replica's report, whichever is larger."""
        reported = self.report.requests if self.report is not None else 0.0
        return max(float(self.in_flight), reported)

    def begin(self, tokens: int) -> Dispatch:
        self.in_flight += 1
        self.in_flight_tokens += tokens
        self.breaker.on_dispatch()
        return Dispatch(self, tokens)

    # --- eligibility and health ------------------------------------------------------------------
    def is_eligible(self) -> bool:
        return self.healthy and not self.removed and self.breaker.allows()

    def mark_up(self) -> None:
        self.failed_probes = 0
        if not self.healthy:
            logger.warning("replica %s is healthy", self.url)
            self.healthy = True
            self.last_change = time.monotonic()

    def mark_down(self, reason: str) -> None:
        """Take the replica out and cut its attempts in flight (their requests retry elsewhere if not streamed)."""
        if self.healthy:
            logger.warning("replica %s taken out: %s", self.url, reason)
            self.healthy = False
            self.last_change = time.monotonic()
        self.report = None
        for attempt in list(self._attempts):
            attempt.cancel()

    def on_probe_failed(self, reason: str, unhealthy_after: int) -> None:
        self.failed_probes += 1
        if self.failed_probes >= unhealthy_after or not self.healthy:
            self.mark_down(f"{self.failed_probes} failed health probe(s): {reason}")

    def on_report(self, report: LoadReport | None) -> None:
        if report is not None:
            ttft = recent_ttft_s(self.report, report)
            self.recent_ttft_s = ttft if ttft is not None else self.recent_ttft_s
        self.report = report

    # --- attempts --------------------------------------------------------------------------------
    async def run(self, work: Awaitable[T]) -> T:
        """Await `work` as a task this replica can cancel; ReplicaDown if it was cut by `mark_down`.

        Cancelling the caller (its client left) cancels the work too; it is awaited, so its cleanup has run.
        """
        task = asyncio.ensure_future(work)
        self._attempts.add(task)
        try:
            await asyncio.wait({task})
        finally:
            self._attempts.discard(task)
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            raise ReplicaDown(f"replica {self.url} was taken out")
        return task.result()

    @property
    def attempts_in_flight(self) -> int:
        return len(self._attempts)
