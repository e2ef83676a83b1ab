"""Redis tier: entries as Redis strings on a server several engines share, bounded by `max_bytes` in total.

    deepserve:kv:<entry name>   the entry bytes
    deepserve:kv:lru            sorted set: entry key -> last use (unix seconds)
    deepserve:kv:bytes          counter: bytes of every entry the LRU lists

A put and its evictions run as one Lua script (atomic on the server), so several engines sharing the server keep
the counter and the LRU consistent; least recently used entries go first once the counter passes the bound.

A server that goes away never fails a request: a command that errs or times out (`timeout_s`) makes the tier
count as down, with one warning; while down every get is a miss and every put is dropped (the engine recomputes
those blocks); after `retry_interval_s` the next command tries the server again, and the first that succeeds
logs the reconnection.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)

PREFIX = "deepserve:kv:"
LRU_KEY = PREFIX + "lru"
BYTES_KEY = PREFIX + "bytes"

_PUT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('ZADD', KEYS[2], ARGV[2], KEYS[1])
  return {0, tonumber(redis.call('GET', KEYS[3]) or 0)}
end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[2], KEYS[1])
local total = redis.call('INCRBY', KEYS[3], string.len(ARGV[1]))
local evicted = 0
while total > tonumber(ARGV[3]) do
  local oldest = redis.call('ZPOPMIN', KEYS[2])
  if #oldest == 0 then break end
  local size = redis.call('STRLEN', oldest[1])
  redis.call('DEL', oldest[1])
  total = redis.call('DECRBY', KEYS[3], size)
  evicted = evicted + 1
end
return {evicted, total}
"""

_REMOVE = """
local size = redis.call('STRLEN', KEYS[1])
if redis.call('DEL', KEYS[1]) == 1 then redis.call('DECRBY', KEYS[3], size) end
redis.call('ZREM', KEYS[2], KEYS[1])
return size
"""


class RedisTier:
    name = "redis"
    shared = True

    def __init__(self, url: str, max_bytes: int, timeout_s: float, retry_interval_s: float) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise ValueError("kv_store.backend 'redis' needs the redis package: pip install 'deepserve[kvstore]'") \
                from None
        self._errors_caught = (redis.exceptions.RedisError, OSError)
        # No client-side retries: a gone server is handled here (down, retried later), not by blocking the engine.
        self._client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                            retry=Retry(NoBackoff(), 0))
        self.url = url
        self.max_bytes = max_bytes
        self.retry_interval_s = retry_interval_s
        self.evictions = 0
        self.errors = 0
        self.reconnects = 0
        self.used_bytes = 0         # the server's counter as of this process's last put
        self.down = False
        self._retry_at = 0.0
        self._lock = threading.Lock()
        self._put = self._client.register_script(_PUT)
        self._remove = self._client.register_script(_REMOVE)
        if self._call(lambda c: c.ping(), None) is None:
            logger.warning("kv store: Redis at %s is not reachable now; blocks are recomputed until it is", url)

    @staticmethod
    def key(name: str) -> str:
        return PREFIX + name

    def get(self, name: str) -> bytes | None:
        key = self.key(name)

        def fetch(client):
            pipe = client.pipeline(transaction=False)
            pipe.get(key)
            pipe.zadd(LRU_KEY, {key: time.time()}, xx=True)     # a read makes the entry recent
            return pipe.execute()[0]
        return self._call(fetch, None)

    def contains(self, names: list[str]) -> list[bool]:
        def exists(client):
            pipe = client.pipeline(transaction=False)
            for n in names:
                pipe.exists(self.key(n))
            return [bool(x) for x in pipe.execute()]
        return self._call(exists, [False] * len(names))

    def put(self, name: str, data: bytes) -> None:
        if len(data) > self.max_bytes:
            return
        result = self._call(lambda c: self._put(keys=[self.key(name), LRU_KEY, BYTES_KEY],
                                                args=[data, time.time(), self.max_bytes], client=c), None)
        if result is not None:
            evicted, self.used_bytes = int(result[0]), int(result[1])
            self.evictions += evicted

    def remove(self, name: str) -> None:
        self._call(lambda c: self._remove(keys=[self.key(name), LRU_KEY, BYTES_KEY], client=c), None)

    def _call(self, command, default):
        """Run `command(client)`; on any server or socket error mark the tier down and return `default`."""
        if self.down and time.monotonic() < self._retry_at:
            return default
        try:
            result = command(self._client)
        except self._errors_caught as e:
            with self._lock:
                self.errors += 1
                if not self.down:
                    logger.warning("kv store: Redis at %s failed (%s); blocks are recomputed, retrying every %.1f s",
                                   self.url, e, self.retry_interval_s)
                self.down = True
                self._retry_at = time.monotonic() + self.retry_interval_s
            return default
        if self.down:
            with self._lock:
                if self.down:
                    self.down = False
                    self.reconnects += 1
                    logger.warning("kv store: Redis at %s is back", self.url)
        return result

    def close(self) -> None:
        try:
            self._client.close()
        except self._errors_caught:
            pass
