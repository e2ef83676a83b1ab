"""RedisTier against a real redis-server: the byte bound on the server, and a server that dies and comes back."""

from __future__ import annotations

import logging
import time

from deepserve.kvstore.redis_tier import BYTES_KEY, RedisTier


def tier(server, max_bytes=10_000, retry=0.2):
    return RedisTier(server.url, max_bytes, timeout_s=0.5, retry_interval_s=retry)


def test_put_get_contains(redis_server):
    t = tier(redis_server)
    t.put("fp-01", b"abc")
    assert t.get("fp-01") == b"abc" and t.get("fp-02") is None
    assert t.contains(["fp-01", "fp-02"]) == [True, False]
    t.remove("fp-01")
    assert t.get("fp-01") is None and int(t._client.get(BYTES_KEY)) == 0


def test_bound_evicts_least_recently_used_on_the_server(redis_server):
    t = tier(redis_server, max_bytes=1000)
    for i in range(3):
        t.put(f"fp-0{i}", bytes(300))
        time.sleep(0.01)
    t.get("fp-00")                           # read: the most recent now
    t.put("fp-03", bytes(300))
    assert t.contains([f"fp-0{i}" for i in range(4)]) == [True, False, True, True]
    assert t.evictions == 1 and t.used_bytes == 900 == int(t._client.get(BYTES_KEY))
    other = tier(redis_server, max_bytes=1000)  # a second engine shares the bound
    other.put("fp-04", bytes(300))
    assert other.evictions == 1 and int(other._client.get(BYTES_KEY)) == 900


def test_dead_server_is_a_miss_with_one_warning_then_reconnects(redis_server, caplog):
    t = tier(redis_server)
    t.put("fp-01", b"abc")
    redis_server.kill()
    with caplog.at_level(logging.WARNING, logger="deepserve.kvstore.redis_tier"):
        assert t.get("fp-01") is None          # no exception: a miss
        t.put("fp-02", b"x")
        assert t.contains(["fp-01"]) == [False]
    assert t.down and t.errors == 1 and len([r for r in caplog.records if "failed" in r.message]) == 1
    redis_server.start()                     # empty: no persistence
    time.sleep(0.25)
    t.put("fp-03", b"back")
    assert not t.down and t.reconnects == 1 and t.get("fp-03") == b"back"
