"""KVStore: tiers in order, promotion of lower-tier hits, checksum failures, the write-behind queue."""

from __future__ import annotations

import torch

from deepserve.kvstore.codec import encode
from deepserve.kvstore.disk_tier import DiskTier
from deepserve.kvstore.memory_tier import MemoryTier
from deepserve.kvstore.store import KVStore


def block(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 16, 2, 8, generator=g) for _ in range(2)]


def test_saved_blocks_reach_every_tier_and_lower_hits_are_promoted(tmp_path):
    memory, disk = MemoryTier(1 << 20), DiskTier(str(tmp_path), 1 << 20)
    store = KVStore([memory, disk])
    for i in range(3):
        assert store.save(f"fp-0{i}", block(i))
    assert store.flush(timeout=10)
    assert len(memory) == 3 and all(disk.contains([f"fp-0{i}" for i in range(3)]))
    assert store.lookup(["fp-00", "fp-01", "fp-09", "fp-02"]) == 2       # the leading run only
    memory.remove("fp-01")
    out = store.load("fp-01")
    assert all(torch.equal(a, b) for a, b in zip(out, block(1)))
    m = store.metrics()["tiers"]
    assert m["memory"]["misses"] == 1 and m["disk"]["hits"] == 1
    assert memory.get("fp-01") is not None                              # promoted
    store.close()


def test_a_corrupt_copy_counts_and_the_next_tier_serves(tmp_path):
    memory, disk = MemoryTier(1 << 20), DiskTier(str(tmp_path), 1 << 20)
    store = KVStore([memory, disk])
    disk.put("fp-01", encode("fp-01", block(1)))
    memory.put("fp-01", encode("fp-01", block(1))[:-3])                # truncated in memory
    out = store.load("fp-01")
    assert all(torch.equal(a, b) for a, b in zip(out, block(1)))
    m = store.metrics()
    assert m["checksum_failures"] == 1 and m["tiers"]["memory"]["checksum_failures"] == 1
    with open(disk.path_of("fp-01"), "r+b") as f:                      # now corrupt on disk, gone from memory
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0xFF]))
    memory.remove("fp-01")
    assert store.load("fp-01") is None and store.metrics()["checksum_failures"] == 2
    assert not disk.contains(["fp-01"])[0]                              # removed: rewritten by a later save
    store.close()


def test_queue_past_its_bound_drops_saves_and_queued_blocks_are_readable():
    store = KVStore([MemoryTier(1 << 20)], max_pending_bytes=1)         # every block is over the bound
    assert not store.save("fp-01", block(1))
    assert store.metrics()["saves_dropped"] == 1 and store.load("fp-01") is None
    roomy = KVStore([MemoryTier(1 << 20)])
    roomy.save("fp-02", block(2))
    assert roomy.load("fp-02") is not None and roomy.has("fp-02")       # queued or written, either way readable
    roomy.close()
    assert roomy.metrics()["pending_blocks"] == 0


def test_metrics_export_to_prometheus_families(tmp_path):
    from deepserve.serving.openai.metrics import kv_store_metrics

    store = KVStore([MemoryTier(1 << 20), DiskTier(str(tmp_path), 1 << 20)])
    store.save("fp-01", block(1))
    store.flush(timeout=10)
    store.load("fp-01")
    families = {f.name: f for f in kv_store_metrics("m", store.metrics())}
    hits = {s.labels["tier"]: s.value for s in families["deepserve:kv_store_hits"].samples}
    written = {s.labels["tier"]: s.value for s in families["deepserve:kv_store_written_bytes"].samples}
    assert hits == {"memory": 1.0, "disk": 0.0} and written["disk"] > 0
    assert families["deepserve:kv_store_load_blocks"].samples[0].value == 1.0
    store.close()
