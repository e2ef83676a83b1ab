"""The replicas the router routes to: the `--replica` URLs plus those of `--replicas-file`, re-read when the
file changes (its mtime or size, checked at each health round) or on SIGHUP, so that an orchestrator adds
and removes replicas without restarting the router.

The file holds one URL per line (`http://host:port`; a bare `host:port` means http); blank lines and
#comments are skipped. A file that cannot be read keeps the current set (an orchestrator rewriting it must
not empty the fleet for a moment); at start-up it is an error. A removed replica gets no new request and
drains: the requests it already has run to their end.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

from deepserve.router.circuit_breaker import CircuitBreaker
from deepserve.router.replica import Replica

logger = logging.getLogger(__name__)


def normalize_url(raw: str) -> str:
    url = raw.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    try:
        parts.port          # raises on a port that is not a number in range
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not a replica URL: {raw!r} (expected http://host:port)")
    return url


def read_replicas_file(path: str) -> list[str]:
    with open(path, encoding="utf-8") as f:
        lines = [line.split("#", 1)[0].strip() for line in f]
    return [normalize_url(line) for line in lines if line]


class ReplicaSet:
    def __init__(self, static_urls: Iterable[str], replicas_file: str | None,
                 new_breaker: Callable[[], CircuitBreaker]) -> None:
        self.static_urls = [normalize_url(u) for u in static_urls]
        self.replicas_file = replicas_file
        self._new_breaker = new_breaker
        self._replicas: dict[str, Replica] = {}
        # Removed replicas still finishing requests: shown (/router/replicas) so that whoever stops them (the local
        # cluster's supervisor) can wait for their last request; forgotten once idle.
        self._draining: dict[str, Replica] = {}
        self._file_stamp: tuple[int, int] | None = None
        self._changed = asyncio.Event()
        # Callbacks on membership changes: the policy forgets removed replicas, the health checker probes new ones.
        self.on_added: list[Callable[[Replica], None]] = []
        self.on_removed: list[Callable[[Replica], None]] = []
        file_urls = read_replicas_file(replicas_file) if replicas_file else []   # a bad file fails at start-up
        self._file_stamp = self._stamp()
        self._apply([*self.static_urls, *file_urls])

    def __iter__(self):
        return iter(list(self._replicas.values()))

    def __len__(self) -> int:
        return len(self._replicas)

    def get(self, url: str) -> Replica | None:
        return self._replicas.get(url)

    def eligible(self) -> list[Replica]:
        return [r for r in self._replicas.values() if r.is_eligible()]

    def draining(self) -> list[Replica]:
        """Removed replicas with requests still in flight there."""
        for url in [u for u, r in self._draining.items() if r.in_flight == 0]:
            del self._draining[url]
        return list(self._draining.values())

    # --- membership ------------------------------------------------------------------------------
    def reload(self) -> bool:
        """Re-read the replicas file; False (set unchanged) if it cannot be read or parsed."""
        if not self.replicas_file:
            return True
        try:
            file_urls = read_replicas_file(self.replicas_file)
        except (OSError, ValueError) as error:
            logger.warning("keeping the current replicas: cannot read %s: %s", self.replicas_file, error)
            return False
        self._file_stamp = self._stamp()
        self._apply([*self.static_urls, *file_urls])
        return True

    def reload_if_changed(self) -> None:
        if self.replicas_file and self._stamp() != self._file_stamp:
            self.reload()

    def _stamp(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.replicas_file) if self.replicas_file else None
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size) if st is not None else None

    def _apply(self, urls: list[str]) -> None:
        wanted = dict.fromkeys(urls)
        for url in [u for u in self._replicas if u not in wanted]:
            replica = self._replicas.pop(url)
            replica.removed = True
            self._draining[url] = replica
            logger.warning("replica %s removed (draining %d request(s))", url, replica.in_flight)
            for callback in self.on_removed:
                callback(replica)
        for url in wanted:
            if url not in self._replicas:
                self._draining.pop(url, None)      # listed again: the new entry counts its requests from now
                replica = self._replicas[url] = Replica(url, self._new_breaker())
                logger.warning("replica %s added", url)
                for callback in self.on_added:
                    callback(replica)
        self.notify()

    # --- waiting for a replica -------------------------------------------------------------------
    def notify(self) -> None:
        """Wake the requests waiting for an eligible replica (one came up or was added)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_for_change(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
