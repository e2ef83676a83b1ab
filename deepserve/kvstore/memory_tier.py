"""Host-memory tier: entry bytes in an LRU bounded by total bytes.

Invariants: `used_bytes` == the sum of the stored entries' lengths <= `max_bytes` after every put (an entry larger
than the whole tier is not stored); a get moves the entry to the most recently used end. Thread-safe: the engine
thread reads while the store's writer thread puts.
"""

from __future__ import annotations

import threading
from collections import OrderedDict


class MemoryTier:
    name = "memory"
    shared = False          # seen by this process only

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self.evictions = 0
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, name: str) -> bytes | None:
        with self._lock:
            data = self._entries.get(name)
            if data is not None:
                self._entries.move_to_end(name)
            return data

    def contains(self, names: list[str]) -> list[bool]:
        with self._lock:
            return [n in self._entries for n in names]

    def put(self, name: str, data: bytes) -> None:
        if len(data) > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(name, None)
            if old is not None:
                self.used_bytes -= len(old)
            self._entries[name] = data
            self.used_bytes += len(data)
            while self.used_bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self.used_bytes -= len(evicted)
                self.evictions += 1

    def remove(self, name: str) -> None:
        with self._lock:
            old = self._entries.pop(name, None)
            if old is not None:
                self.used_bytes -= len(old)

    def close(self) -> None:
        pass
