"""The tiered KV store: host memory, then disk or Redis; write-behind saves; metrics.

    save(name, tensors)   queue a block's host copy; the writer thread encodes it and puts it in every tier
    lookup(names)         how many leading names some tier (or the queue) holds: the run a prefix can load
    load(name)            the block's tensors from the first tier holding an intact copy, or None

In an engine, `lookup` and `load` run on the fetcher's threads (kvstore/fetcher.py), several at once, never on the
engine thread; `has` and `save` run on the engine thread.

Invariants:
- the engine thread never waits for a write: saves past `max_pending_bytes` of queued blocks are dropped
  (counted in `saves_dropped`); a queued block is readable (`load`) before it is written;
- `load` returns only what the codec verified for that exact name: a corrupt or truncated entry counts as a
  checksum failure, is removed from its tier and the next tier is tried; nothing wrong in a tier raises;
- a hit in a lower tier is copied into the tiers above it (memory), so the next load of it is a memory hit;
- `close()` (also run at interpreter exit) writes what is queued before the process goes.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from deepserve.config import KVStoreConfig
from deepserve.kvstore.codec import CorruptEntry, decode, encode
from deepserve.kvstore.disk_tier import DiskTier
from deepserve.kvstore.memory_tier import MemoryTier

logger = logging.getLogger(__name__)

_KNOWN_NAMES = 1 << 18      # names this process knows are stored: saves of them are skipped


@dataclass
class TierMetrics:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    checksum_failures: int = 0


@dataclass
class Latency:
    count: int = 0
    total_s: float = 0.0
    max_s: float = 0.0

    def add(self, seconds: float, n: int = 1) -> None:
        self.count += n
        self.total_s += seconds
        self.max_s = max(self.max_s, seconds / max(n, 1))

    def as_dict(self) -> dict:
        return {"count": self.count, "total_s": self.total_s, "max_s": self.max_s,
                "mean_s": self.total_s / self.count if self.count else 0.0}


@dataclass
class _Pending:
    """Blocks queued for the writer thread, oldest first; shared by the engine thread and the writer."""
    blocks: OrderedDict = field(default_factory=OrderedDict)     # name -> host tensors
    nbytes: int = 0
    stopping: bool = False


def build_tiers(config: KVStoreConfig) -> list:
    tiers = []
    if config.memory_bytes > 0:
        tiers.append(MemoryTier(config.memory_bytes))
    if config.backend == "disk":
        tiers.append(DiskTier(config.path, config.disk_bytes))
    elif config.backend == "redis":
        from deepserve.kvstore.redis_tier import RedisTier
        tiers.append(RedisTier(config.url, config.redis_bytes, config.timeout_s, config.retry_interval_s))
    return tiers


class KVStore:
    def __init__(self, tiers: list, max_pending_bytes: int = 1 << 30) -> None:
        self.tiers = tiers
        self.max_pending_bytes = max_pending_bytes
        self.tier_metrics = {t.name: TierMetrics() for t in tiers}
        self.save_latency = Latency()         # encode + write of one block, on the writer thread
        self.load_latency = Latency()         # read + verify of one block, on a fetcher thread (kvstore/fetcher.py)
        self._metrics_lock = threading.Lock()  # loads run on several fetcher threads at once
        self.saves_dropped = 0
        self._pending = _Pending()
        self._cond = threading.Condition()
        self._known: OrderedDict[str, None] = OrderedDict()
        # The thread holds the store weakly, so a store nobody uses is collected (its finalizer stops the thread).
        self._writer = threading.Thread(target=_write_loop,
                                        args=(self._pending, self._cond, weakref.WeakMethod(self._write)),
                                        name="kvstore-writer", daemon=True)
        self._writer.start()
        self._finalizer = weakref.finalize(self, _stop_writer, self._pending, self._cond, self._writer, tiers)

    @classmethod
    def from_config(cls, config: KVStoreConfig) -> KVStore:
        return cls(build_tiers(config), config.max_pending_bytes)

    # --- the engine thread (has, save) and the fetcher threads (lookup, load) -----------------
    def has(self, name: str) -> bool:
        """Known to be stored or queued by this process (a save of it would be redundant)."""
        with self._cond:
            if name in self._pending.blocks:
                return True
        if not any(t.shared for t in self.tiers):
            return self.tiers[0].contains([name])[0]     # host memory alone: exact, and it evicts
        with self._cond:
            return name in self._known

    def save(self, name: str, tensors: list[torch.Tensor]) -> bool:
        """Queue one block (host tensors the caller no longer writes). False when dropped: the queue is full."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if self.has(name):
            return True
        with self._cond:
            if self._pending.nbytes + nbytes > self.max_pending_bytes:
                self.saves_dropped += 1
                return False
            self._pending.blocks[name] = tensors
            self._pending.nbytes += nbytes
            self._cond.notify()
        return True

    def lookup(self, names: list[str]) -> int:
        """Length of the leading run of `names` that is queued or held by some tier."""
        found = [False] * len(names)
        with self._cond:
            for i, n in enumerate(names):
                found[i] = n in self._pending.blocks
        for tier in self.tiers:
            missing = [i for i, f in enumerate(found) if not f]
            if not missing:
                break
            for i, present in zip(missing, tier.contains([names[i] for i in missing])):
                found[i] = found[i] or present
        run = 0
        while run < len(names) and found[run]:
            run += 1
        return run

    def load(self, name: str) -> list[torch.Tensor] | None:
        """The block's tensors (verified) or None; a hit is copied into the tiers above the one that had it."""
        t0 = time.perf_counter()
        with self._cond:
            queued = self._pending.blocks.get(name)
        if queued is not None:
            return queued
        for level, tier in enumerate(self.tiers):
            m = self.tier_metrics[tier.name]
            data = tier.get(name)
            if data is None:
                with self._metrics_lock:
                    m.misses += 1
                continue
            try:
                tensors = decode(name, data)
            except CorruptEntry as e:
                with self._metrics_lock:
                    m.checksum_failures += 1
                logger.warning("kv store: %s tier: %s; removed, the block is recomputed", tier.name, e)
                tier.remove(name)
                continue
            for upper in self.tiers[:level]:
                upper.put(name, data)
            self._remember(name)
            with self._metrics_lock:
                m.hits += 1
                m.bytes_read += len(data)
                self.load_latency.add(time.perf_counter() - t0)
            return tensors
        self._forget(name)
        return None

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending.blocks:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 0.1)
        return True

    def close(self) -> None:
        self._finalizer()

    def metrics(self) -> dict:
        tiers = {}
        for tier in self.tiers:
            m = self.tier_metrics[tier.name]
            tiers[tier.name] = {**m.__dict__, "evictions": tier.evictions, "used_bytes": tier.used_bytes,
                                "max_bytes": tier.max_bytes, "errors": getattr(tier, "errors", 0)}
        with self._cond:
            pending, pending_bytes = len(self._pending.blocks), self._pending.nbytes
        return {"tiers": tiers, "save_latency": self.save_latency.as_dict(),
                "load_latency": self.load_latency.as_dict(), "saves_dropped": self.saves_dropped,
                "pending_blocks": pending, "pending_bytes": pending_bytes,
                "checksum_failures": sum(m.checksum_failures for m in self.tier_metrics.values())}

    # --- the writer thread -------------------------------------------------------------------
    def _write(self, name: str, tensors: list[torch.Tensor]) -> None:
        t0 = time.perf_counter()
        data = encode(name, tensors)
        for tier in self.tiers:
            tier.put(name, data)
            self.tier_metrics[tier.name].bytes_written += len(data)
        self._remember(name)
        self.save_latency.add(time.perf_counter() - t0)

    def _remember(self, name: str) -> None:
        with self._cond:
            self._known[name] = None
            self._known.move_to_end(name)
            if len(self._known) > _KNOWN_NAMES:
                self._known.popitem(last=False)

    def _forget(self, name: str) -> None:
        with self._cond:
            self._known.pop(name, None)


def _write_loop(pending: _Pending, cond: threading.Condition, write_ref: weakref.WeakMethod) -> None:
    """Encode and write queued blocks, oldest first, until stopped with nothing left. A block leaves the queue
    only once written, so a load meanwhile finds it there."""
    while True:
        with cond:
            while not pending.blocks and not pending.stopping:
                cond.wait()
            if not pending.blocks:
                return
            name, tensors = next(iter(pending.blocks.items()))
        write = write_ref()
        if write is None:
            return
        try:
            write(name, tensors)
        except Exception:            # a bug in one save must not stop the others
            logger.exception("kv store: saving %s failed", name)
        del write
        with cond:
            pending.blocks.pop(name, None)
            pending.nbytes -= sum(t.numel() * t.element_size() for t in tensors)
            cond.notify_all()


def _stop_writer(pending: _Pending, cond: threading.Condition, writer: threading.Thread, tiers: list) -> None:
    with cond:
        pending.stopping = True
        cond.notify_all()
    if threading.current_thread() is not writer:
        writer.join(timeout=60)
    for tier in tiers:
        tier.close()
