"""Disk tier: one file per entry under a directory that several engine processes (or hosts, over NFS / Lustre /
3FS) may share.

    PATH/<fingerprint>/<2 hex>/<entry name>.kv

Why it is safe to share:
- a file appears whole or not at all: written to a temp file in the same directory, fsync'd, then renamed
  (atomic on POSIX filesystems), so a reader never sees a half-written entry under its final name;
- a reader that loses a race with a deleter (eviction by another process) gets a miss, not an error;
- anything else wrong with a file (truncated, corrupt) is caught by the codec's checksum, and the file removed.
Size bound: this process counts the bytes it writes on top of a scan of the directory; past `max_bytes` it scans
again (seeing the other processes' files too) and deletes the least recently used files (mtime; a read touches
the file) down to 90% of the bound. Several processes may evict at once: each only deletes, so the worst case is
evicting a little more than needed.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading

logger = logging.getLogger(__name__)

_SUFFIX = ".kv"
_LOW_WATER = 0.9


class DiskTier:
    name = "disk"
    shared = True

    def __init__(self, path: str, max_bytes: int) -> None:
        self.root = os.path.expanduser(path)
        self.max_bytes = max_bytes
        self.evictions = 0
        self.errors = 0
        self._lock = threading.Lock()
        os.makedirs(self.root, exist_ok=True)
        self.used_bytes = sum(size for _, size, _ in self._scan())

    def path_of(self, name: str) -> str:
        fingerprint, _, block = name.partition("-")
        return os.path.join(self.root, fingerprint, block[:2], name + _SUFFIX)

    def get(self, name: str) -> bytes | None:
        path = self.path_of(name)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:           # e.g. ESTALE on NFS after another host evicted it
            self._error("read", path, e)
            return None
        try:
            os.utime(path)              # LRU: a read makes the entry recent
        except OSError:
            pass
        return data

    def contains(self, names: list[str]) -> list[bool]:
        return [os.path.exists(self.path_of(n)) for n in names]

    def put(self, name: str, data: bytes) -> None:
        if len(data) > self.max_bytes:
            return
        path = self.path_of(name)
        if os.path.exists(path):
            return                      # content-addressed: the same name holds the same bytes
        directory = os.path.dirname(path)
        try:
            os.makedirs(directory, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=_SUFFIX, dir=directory)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                _unlink(tmp)
                raise
        except OSError as e:
            self._error("write", path, e)
            return
        with self._lock:
            self.used_bytes += len(data)
            over = self.used_bytes > self.max_bytes
        if over:
            self.evict()

    def remove(self, name: str) -> None:
        _unlink(self.path_of(name))

    def evict(self) -> None:
        """Delete the least recently used files until the directory holds at most 90% of `max_bytes`."""
        with self._lock:
            files = sorted(self._scan(), key=lambda f: f[2])
            total = sum(size for _, size, _ in files)
            target = int(self.max_bytes * _LOW_WATER)
            for path, size, _ in files:
                if total <= target:
                    break
                if _unlink(path):
                    self.evictions += 1
                total -= size
            self.used_bytes = total

    def _scan(self) -> list[tuple[str, int, float]]:
        """(path, size, mtime) of every entry file under the root, of every fingerprint."""
        found = []
        for dirpath, _, filenames in os.walk(self.root):
            for fn in filenames:
                if not fn.endswith(_SUFFIX) or fn.startswith(".tmp-"):
                    continue
                path = os.path.join(dirpath, fn)
                try:
                    st = os.stat(path)
                except OSError:
                    continue            # deleted by another process meanwhile
                found.append((path, st.st_size, st.st_mtime))
        return found

    def _error(self, what: str, path: str, e: OSError) -> None:
        self.errors += 1
        logger.warning("kv store disk tier: cannot %s %s (%s); the block is recomputed", what, path, e)

    def close(self) -> None:
        pass


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
