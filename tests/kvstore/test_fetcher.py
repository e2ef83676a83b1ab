"""Fetcher (kvstore/fetcher.py) over a real store: the run it reads, the byte cap, cancellation, its threads."""

from __future__ import annotations

import gc
import threading
import time

import torch

from deepserve.kvstore.fetcher import Fetch, Fetcher, layout_bytes
from deepserve.kvstore.memory_tier import MemoryTier
from deepserve.kvstore.store import KVStore

LAYOUTS = [((2, 16, 2, 8), torch.float32)] * 2
BLOCK = layout_bytes(LAYOUTS)


def block(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=dtype) for shape, dtype in LAYOUTS]


class SlowMemory(MemoryTier):
    def __init__(self, delay_s):
        super().__init__(1 << 24)
        self.delay_s = delay_s
        self.reads = 0

    def get(self, name):
        self.reads += 1
        time.sleep(self.delay_s)
        return super().get(name)


def filled_store(n, tier=None):
    store = KVStore([tier if tier is not None else MemoryTier(1 << 24)])
    for i in range(n):
        store.save(f"fp-{i:02d}", block(i))
    assert store.flush(timeout=10)
    return store


def finished(fetch, timeout=10):
    assert fetch.done.wait(timeout), "the fetch did not finish"
    return fetch


def test_reads_the_leading_run_and_passes_over_device_held_positions():
    store = filled_store(4)
    fetcher = Fetcher(store, LAYOUTS, 1 << 20)
    fetch = finished(fetcher.submit(["fp-00", None, "fp-01", "fp-02", "fp-09", "fp-03"]))
    assert fetch.held == 3 and not fetch.failed and not fetch.deferred
    assert [t is None for t in fetch.tensors] == [False, True, False, False]
    assert all(torch.equal(a, b) for a, b in zip(fetch.tensors[3], block(2)))
    assert fetcher.budget.reserved == 3 * BLOCK
    fetch.release()
    fetch.release()                                  # idempotent
    assert fetcher.budget.reserved == 0 and fetch.tensors == []


def test_a_block_of_another_layout_fails_the_run_there():
    store = filled_store(2)
    store.save("fp-02", [torch.zeros(3)])
    store.flush(timeout=10)
    fetcher = Fetcher(store, LAYOUTS, 1 << 20)
    fetch = finished(fetcher.submit(["fp-00", "fp-02", "fp-01"]))
    assert fetch.held == 3 and fetch.failed and len(fetch.tensors) == 1      # the lookup saw it; decoding refused it


def test_the_byte_cap_cuts_a_lone_fetch_and_defers_one_beside_another():
    store = filled_store(6)
    fetcher = Fetcher(store, LAYOUTS, 4 * BLOCK)
    alone = finished(fetcher.submit([f"fp-{i:02d}" for i in range(6)]))
    assert alone.truncated and len(alone.tensors) == 4 and fetcher.budget.reserved == 4 * BLOCK
    beside = finished(fetcher.submit(["fp-00", "fp-01"]))
    assert beside.deferred and beside.tensors == [] and not fetcher.budget.fits(2, BLOCK)
    alone.release()
    assert fetcher.budget.fits(2, BLOCK)
    again = finished(fetcher.submit(["fp-00", "fp-01"]))
    assert not again.deferred and len(again.tensors) == 2
    assert fetcher.budget.high_water == 4 * BLOCK


def test_a_cap_below_one_block_reads_nothing_and_never_defers():
    fetcher = Fetcher(filled_store(1), LAYOUTS, BLOCK - 1)
    fetch = finished(fetcher.submit(["fp-00"]))
    assert fetch.held == 1 and fetch.tensors == [] and not fetch.deferred and fetch.truncated


def test_cancel_stops_the_worker_and_gives_its_bytes_back():
    tier = SlowMemory(0.0)
    store = filled_store(20, tier)
    fetcher = Fetcher(store, LAYOUTS, 1 << 20)
    tier.delay_s = 0.05
    fetch = fetcher.submit([f"fp-{i:02d}" for i in range(20)])
    deadline = time.monotonic() + 5
    while fetcher.budget.reserved == 0 and time.monotonic() < deadline:
        time.sleep(0.005)                             # until it reserved its bytes and reads
    fetch.cancel()
    finished(fetch)
    deadline = time.monotonic() + 5
    while fetcher.budget.reserved and time.monotonic() < deadline:
        time.sleep(0.005)
    assert fetcher.budget.reserved == 0 and len(fetch.tensors) == 0 and fetcher.num_unfinished == 0
    assert tier.reads < 20                            # it stopped at the next block


def test_a_cancelled_fetch_counted_finished_holds_no_bytes(monkeypatch):
    """The engine reads "no fetch unfinished" as "no fetch bytes reserved": the worker gives a cancelled
    fetch's bytes back before it counts the fetch finished. A slow release widens the window to make it show."""
    tier = SlowMemory(0.0)
    store = filled_store(20, tier)
    fetcher = Fetcher(store, LAYOUTS, 1 << 20)
    tier.delay_s = 0.05
    release = Fetch.release

    def slow_release(self):
        time.sleep(0.2)
        release(self)

    monkeypatch.setattr(Fetch, "release", slow_release)
    fetch = fetcher.submit([f"fp-{i:02d}" for i in range(20)])
    deadline = time.monotonic() + 5
    while fetcher.budget.reserved == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    fetch._cancelled.set()                            # cancel() without its own release: the worker's is the one
    deadline = time.monotonic() + 10
    while fetcher.num_unfinished and time.monotonic() < deadline:
        time.sleep(0.001)
    assert fetcher.num_unfinished == 0 and fetcher.budget.reserved == 0


def test_threads_end_with_the_fetcher():
    fetcher = Fetcher(filled_store(1), LAYOUTS, 1 << 20)
    finished(fetcher.submit(["fp-00"]))
    threads = [t for t in threading.enumerate() if t.name.startswith("kvstore-fetch")]
    assert threads and all(t.daemon for t in threads)
    mine = list(fetcher._threads)
    del fetcher
    gc.collect()
    for t in mine:
        t.join(timeout=5)
        assert not t.is_alive()


def test_a_fetch_queued_when_its_fetcher_goes_still_ends():
    tier = SlowMemory(0.0)
    fetcher = Fetcher(filled_store(2, tier), LAYOUTS, 1 << 20, threads=1)
    tier.delay_s = 0.2
    first = fetcher.submit(["fp-00"])
    queued = fetcher.submit(["fp-01"])
    budget, deadline = fetcher.budget, time.monotonic() + 5
    while budget.reserved == 0 and time.monotonic() < deadline:
        time.sleep(0.005)                             # the thread runs `first` (reading, 0.2 s)
    del fetcher
    gc.collect()
    assert finished(first).tensors and finished(queued).failed
