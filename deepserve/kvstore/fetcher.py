"""Background fetches of stored blocks into host memory: lookup, read, decode and checksum off the engine thread.

    fetcher.submit(names)  -> Fetch     names[i] is position i of a run of blocks (None: the device holds it,
                                        nothing to read); the fetch reads the leading run the store holds
    fetch.done                          set once the worker finished (read `tensors` only then)
    fetch.tensors                       per position: the block's verified per-layer tensors, or None for a
                                        device-held position; it ends where the run ends (miss, failure, cap)
    fetch.cancel() / fetch.release()    drop an unwanted fetch / give its host bytes back once consumed

Invariants:
- host bytes that fetches hold (reserved when the worker knows how many blocks it will read, one block's bytes
  times that count) never exceed `max_bytes`: a fetch that does not fit while others hold bytes is `deferred`
  (it reads nothing; the caller asks again once bytes are released); one that does not fit alone is cut to the
  blocks `max_bytes` holds;
- a fetch's bytes are released exactly once: by `release()` after the caller consumed it, or, for a cancelled
  fetch, by whichever of the caller and the worker sees it finished (release is idempotent), and before the
  fetcher counts it finished;
- nothing a tier does raises out of a fetch: a tier error or a bug ends the run there (`failed`), the rest of the
  prompt is computed by the engine;
- the fetcher never touches the engine's state (block manager, sequences): it only reads the store.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref

import torch

from deepserve.kvstore.store import KVStore

logger = logging.getLogger(__name__)

Layout = tuple[tuple[int, ...], torch.dtype]


def layout_bytes(layouts: list[Layout]) -> int:
    """Host bytes of one block of every layer."""
    return sum(torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size() for shape, dtype in layouts)


class Fetch:
    """One background read of a run of blocks (see the module docstring for who writes what when)."""

    def __init__(self, names: list[str | None], budget: "_ByteBudget") -> None:
        assert names and names[0] is not None, "a fetch starts at a block the device does not hold"
        self.names = names
        self.tensors: list[list[torch.Tensor] | None] = []
        self.held = 0               # leading store names (device-held positions left out) the store's lookup found
        self.failed = False         # a block the lookup found could not be given (missing, corrupt, an error)
        self.deferred = False       # read nothing: the byte cap was held by other fetches
        self.truncated = False      # read fewer than `held` blocks: the byte cap alone was smaller
        self.seconds = 0.0          # the worker's time on it
        self.submitted = time.monotonic()
        self.done = threading.Event()
        self._cancelled = threading.Event()
        self._budget = budget
        self._reserved = 0
        self._lock = threading.Lock()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self) -> None:
        """Stop the worker at the next block and drop what it read; bytes go back once it has finished."""
        self._cancelled.set()
        if self.done.is_set():
            self.release()

    def release(self) -> None:
        """Give the fetch's host bytes back (idempotent); its tensors are dropped."""
        with self._lock:
            reserved, self._reserved = self._reserved, 0
            self.tensors = []
        self._budget.give_back(reserved)

    def _reserve(self, nbytes: int) -> None:
        with self._lock:
            self._reserved = nbytes


class _ByteBudget:
    """Host bytes all fetches may hold at once; shared by the workers (reserve) and the engine thread (give back)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.reserved = 0
        self.high_water = 0          # most bytes ever reserved at once (<= max_bytes)
        self._lock = threading.Lock()

    def take(self, num_blocks: int, block_bytes: int) -> int:
        """Reserve up to `num_blocks` blocks; how many were reserved: all of them if they fit, as many as
        `max_bytes` holds if no other fetch holds bytes, else 0 (the caller defers)."""
        with self._lock:
            if self.reserved + num_blocks * block_bytes <= self.max_bytes:
                granted = num_blocks
            elif self.reserved == 0:
                granted = self.max_bytes // block_bytes
            else:
                granted = 0
            self.reserved += granted * block_bytes
            self.high_water = max(self.high_water, self.reserved)
            return granted

    def give_back(self, nbytes: int) -> None:
        if nbytes:
            with self._lock:
                self.reserved -= nbytes
                assert self.reserved >= 0, "fetch bytes released twice"

    def fits(self, num_blocks: int, block_bytes: int) -> bool:
        """Would `take` reserve something now (a deferred fetch is worth submitting again)?"""
        with self._lock:
            return self.reserved == 0 or self.reserved + num_blocks * block_bytes <= self.max_bytes


class Fetcher:
    """A few daemon threads reading runs of blocks from `store` into host memory, bounded by `max_bytes`.
    The threads start with the first fetch and hold the fetcher weakly: they end with it (or at `close`), and a
    thread stuck in a hung tier never keeps the process from exiting."""

    def __init__(self, store: KVStore, layouts: list[Layout], max_bytes: int, threads: int = 2) -> None:
        self.store = store
        self.layouts = layouts
        self.block_bytes = layout_bytes(layouts)
        self.budget = _ByteBudget(max_bytes)
        self.fetch_s = 0.0          # worker time spent on fetches (lookup, read, decode, checksum)
        self._num_threads = threads
        self._threads: list[threading.Thread] = []
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()     # Fetch, or None: a thread's signal to end
        self._finished = threading.Condition()
        self._unfinished = 0

    def submit(self, names: list[str | None]) -> Fetch:
        fetch = Fetch(names, self.budget)
        with self._finished:
            self._unfinished += 1
        if not self._threads:
            self._threads = [threading.Thread(target=_work_loop, args=(self._jobs, weakref.ref(self)),
                                              name=f"kvstore-fetch-{i}", daemon=True)
                             for i in range(self._num_threads)]
            for thread in self._threads:
                thread.start()
        self._jobs.put(fetch)
        return fetch

    def wait_any(self, timeout: float) -> None:
        """Block until some unfinished fetch finishes, at most `timeout` seconds (at once if none is unfinished)."""
        with self._finished:
            if self._unfinished:
                self._finished.wait(timeout)

    @property
    def num_unfinished(self) -> int:
        with self._finished:
            return self._unfinished

    def close(self) -> None:
        """End the threads once the fetches queued before are done."""
        for _ in self._threads:
            self._jobs.put(None)

    # --- the worker threads -----------------------------------------------------------------------------------
    def _run(self, fetch: Fetch) -> None:
        t0 = time.perf_counter()
        try:
            if not fetch.cancelled:
                self._read(fetch)
        except Exception:            # a bug or an unexpected tier error: the engine computes the rest
            logger.exception("kv store: fetching %s failed; the rest of the prompt is computed", fetch.names[0])
            fetch.failed = True
        finally:
            fetch.seconds = time.perf_counter() - t0
            # `done` before the cancel check (cancel() sets its flag before checking `done`: one of the two sees
            # the other and releases), and the release before the count drops: a fetch counted finished holds
            # no bytes, so "no fetch unfinished" means "no cancelled fetch's bytes reserved".
            fetch.done.set()
            if fetch.cancelled:
                fetch.release()
            with self._finished:
                self.fetch_s += fetch.seconds
                self._unfinished -= 1
                self._finished.notify_all()

    def _read(self, fetch: Fetch) -> None:
        """Fill `fetch.tensors` with the leading run of blocks the store gives intact."""
        store_names = [n for n in fetch.names if n is not None]
        fetch.held = self.store.lookup(store_names)
        if fetch.held == 0:
            return
        granted = self.budget.take(fetch.held, self.block_bytes)
        fetch._reserve(granted * self.block_bytes)
        if granted == 0:
            # Other fetches hold the bytes: ask again later. (A cap below one block reads nothing, ever.)
            fetch.deferred = self.budget.max_bytes >= self.block_bytes
            fetch.truncated = not fetch.deferred
            return
        fetch.truncated = granted < fetch.held
        to_read = granted
        for name in fetch.names:
            if fetch.cancelled:
                return
            if name is None:
                fetch.tensors.append(None)      # the device holds it
                continue
            if to_read == 0:
                return
            tensors = self.store.load(name)
            if tensors is None or not self._fits_layout(tensors):
                fetch.failed = True
                return
            fetch.tensors.append(tensors)
            to_read -= 1

    def _fits_layout(self, tensors: list[torch.Tensor]) -> bool:
        return len(tensors) == len(self.layouts) and all(
            tuple(t.shape) == shape and t.dtype == dtype for t, (shape, dtype) in zip(tensors, self.layouts))


def _work_loop(jobs: queue.SimpleQueue, fetcher_ref: weakref.ref) -> None:
    """One fetch thread: run queued fetches until told to end or the fetcher is gone."""
    while True:
        try:
            fetch = jobs.get(timeout=1.0)
        except queue.Empty:
            if fetcher_ref() is None:
                return
            continue
        fetcher = fetcher_ref()
        if fetch is None:
            return
        if fetcher is None:                 # nobody will read it; still, it ends
            fetch.failed = True
            fetch.done.set()
            return
        fetcher._run(fetch)
        del fetcher, fetch
