"""MemoryTier: LRU within a byte bound."""

from deepserve.kvstore.memory_tier import MemoryTier


def test_bound_evicts_least_recently_used():
    tier = MemoryTier(max_bytes=300)
    for name in "abc":
        tier.put(name, bytes(100))
    assert tier.get("a") is not None              # a is now the most recent
    tier.put("d", bytes(100))
    assert tier.contains(list("abcd")) == [True, False, True, True]
    assert tier.used_bytes == 300 and tier.evictions == 1


def test_an_entry_larger_than_the_tier_is_not_stored():
    tier = MemoryTier(max_bytes=50)
    tier.put("a", bytes(10))
    tier.put("big", bytes(51))
    assert tier.get("big") is None and tier.get("a") is not None and tier.used_bytes == 10


def test_remove_and_replace_keep_the_byte_count():
    tier = MemoryTier(max_bytes=1000)
    tier.put("a", bytes(100))
    tier.put("a", bytes(40))
    assert tier.used_bytes == 40
    tier.remove("a")
    assert tier.used_bytes == 0 and len(tier) == 0
