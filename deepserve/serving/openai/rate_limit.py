"""Token-bucket rate limiting: each client (API key, or address when there are no keys) may send `rate`
requests per second on average, in bursts of up to `burst` (default: one second's worth).

Invariants: a bucket holds between 0 and `burst` tokens; a request takes one token or is refused with the
number of seconds until one will be there (the Retry-After). Buckets left full are forgotten when there
are many clients, so memory stays bounded.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

_MAX_TRACKED_CLIENTS = 10_000


@dataclass
class _Bucket:
    tokens: float
    updated: float


class RateLimiter:
    def __init__(self, rate: float, burst: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be > 0 requests/s, got {rate}")
        self.rate = rate
        self.burst = max(1.0, rate if burst is None else burst)
        self.clock = clock
        self._buckets: dict[str, _Bucket] = {}
        self._lock = threading.Lock()

    def acquire(self, client: str) -> float:
        """Take a token for `client`: 0.0 if allowed, else the seconds to wait before one is available."""
        with self._lock:
            now = self.clock()
            bucket = self._buckets.get(client)
            if bucket is None:
                self._forget_idle(now)
                bucket = self._buckets[client] = _Bucket(self.burst, now)
            bucket.tokens = min(self.burst, bucket.tokens + (now - bucket.updated) * self.rate)
            bucket.updated = now
            if bucket.tokens >= 1.0:
                bucket.tokens -= 1.0
                return 0.0
            return (1.0 - bucket.tokens) / self.rate

    def _forget_idle(self, now: float) -> None:
        if len(self._buckets) < _MAX_TRACKED_CLIENTS:
            return
        refill_time = self.burst / self.rate
        for client in [c for c, b in self._buckets.items() if now - b.updated >= refill_time]:
            del self._buckets[client]


def retry_after_header(wait_s: float) -> str:
    """Retry-After takes whole seconds; round up so a client that obeys it is never refused again at once."""
    return str(max(1, math.ceil(wait_s)))
