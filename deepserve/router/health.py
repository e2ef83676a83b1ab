"""Active health checks: every interval, GET /health on each replica (and its /metrics for a load report).

A replica that fails `unhealthy_after` probes in a row is taken out (its attempts in flight are cut and retried
elsewhere, replica.py); it keeps being probed, and one good probe brings it back. A hung replica (SIGSTOP, a
wedged event loop) accepts the TCP connection and never answers: the probe's timeout is what finds it, long
before a request's read timeout would. Each round also re-reads the replicas file if it changed and trims the
cache-aware tree.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

from deepserve.router.load_report import parse_load_report
from deepserve.router.replica import Replica
from deepserve.router.replica_set import ReplicaSet

logger = logging.getLogger(__name__)


class HealthChecker:
    def __init__(self, replicas: ReplicaSet, client: httpx.AsyncClient, interval_s: float, timeout_s: float,
                 unhealthy_after: int, load_reports: bool = True,
                 after_round: Callable[[], None] | None = None) -> None:
        self.replicas = replicas
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.unhealthy_after = unhealthy_after
        self.load_reports = load_reports
        self.after_round = after_round
        self._probes: set[asyncio.Task] = set()

    async def run(self) -> None:
        while True:
            try:
                await self.check_all()
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad round
                logger.exception("health round failed")
            await asyncio.sleep(self.interval_s)

    async def check_all(self) -> None:
        self.replicas.reload_if_changed()
        await asyncio.gather(*(self.probe(r) for r in self.replicas))
        if self.after_round is not None:
            self.after_round()

    def probe_soon(self, replica: Replica) -> None:
        """Probe a replica now, off the round (a newly added one should not wait a whole interval)."""
        task = asyncio.get_running_loop().create_task(self.probe(replica))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def probe(self, replica: Replica) -> None:
        was_eligible = replica.is_eligible()
        try:
            response = await self.client.get(replica.url + "/health", timeout=self.timeout_s)
            problem = None if response.status_code == 200 else f"/health answered {response.status_code}"
        except httpx.HTTPError as error:
            problem = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        if problem is not None:
            replica.on_probe_failed(problem, self.unhealthy_after)
            return
        replica.mark_up()
        if self.load_reports:
            replica.on_report(await self._load_report(replica))
        if replica.is_eligible() != was_eligible:
            self.replicas.notify()

    async def _load_report(self, replica: Replica):
        try:
            response = await self.client.get(replica.url + "/metrics", timeout=self.timeout_s)
        except httpx.HTTPError:
            return None
        return parse_load_report(response.text) if response.status_code == 200 else None
