"""DiskTier: atomic files, LRU size bound over the whole directory, several users of one directory."""

from __future__ import annotations

import os
import time

from deepserve.kvstore.disk_tier import DiskTier


def files(root):
    return sorted(fn for _, _, fns in os.walk(root) for fn in fns)


def test_put_get_and_no_temp_files_left(tmp_path):
    tier = DiskTier(str(tmp_path), max_bytes=10_000)
    tier.put("fp-aa01", b"x" * 100)
    assert tier.get("fp-aa01") == b"x" * 100
    assert tier.get("fp-bb02") is None
    assert files(tmp_path) == ["fp-aa01.kv"]
    assert tier.path_of("fp-aa01") == os.path.join(str(tmp_path), "fp", "aa", "fp-aa01.kv")


def test_bound_evicts_least_recently_used_files(tmp_path):
    tier = DiskTier(str(tmp_path), max_bytes=1000)
    for i in range(4):
        tier.put(f"fp-{i:02x}", bytes(240))
        os.utime(tier.path_of(f"fp-{i:02x}"), (time.time() - 100 + i, time.time() - 100 + i))
    tier.get("fp-00")                       # read: now the most recent
    tier.put("fp-04", bytes(240))           # 1200 > 1000: down to 900 -> the two oldest unread go
    assert tier.contains([f"fp-{i:02x}" for i in range(5)]) == [True, False, False, True, True]
    assert tier.evictions == 2 and tier.used_bytes == 720


def test_two_users_of_one_directory_see_and_bound_each_others_files(tmp_path):
    a = DiskTier(str(tmp_path), max_bytes=1000)
    b = DiskTier(str(tmp_path), max_bytes=1000)
    a.put("fp-01", bytes(400))
    assert b.get("fp-01") == bytes(400)
    assert DiskTier(str(tmp_path), max_bytes=1000).used_bytes == 400      # a new user scans what is there
    os.utime(a.path_of("fp-01"), (time.time() - 50, time.time() - 50))
    for i in (2, 3, 4):                     # b counts 1200 of its own: its scan finds 1600, a's file the oldest
        b.put(f"fp-0{i}", bytes(400))
        os.utime(b.path_of(f"fp-0{i}"), (time.time() - 10 + i, time.time() - 10 + i))
    assert a.get("fp-01") is None
    assert b.contains(["fp-02", "fp-03", "fp-04"]) == [False, True, True] and b.used_bytes == 800


def test_unwritable_directory_is_a_counted_miss_not_an_error(tmp_path):
    tier = DiskTier(str(tmp_path), max_bytes=1000)
    os.makedirs(os.path.join(str(tmp_path), "fp"))
    open(os.path.join(str(tmp_path), "fp", "aa"), "w").close()   # a file where the entry's directory must go
    tier.put("fp-aa01", bytes(10))
    assert tier.errors == 1 and tier.get("fp-aa01") is None
