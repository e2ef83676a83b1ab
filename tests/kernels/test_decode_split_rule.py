"""The paged decode's split counts (kernels/decode_launch.py decode_num_splits / launch_num_splits), host-side
arithmetic checked without a GPU: the H100 / H200's 132 SMs, the shapes whose split counts were timed at kernel level
(merge_splits_*_h100_s43.json): Llama-3.2-1B (8 KV heads of 64, group 4), Llama-3-8B (8 of 128, group 4) and
Qwen3-MoE (4 of 128, group 8)."""

import pytest
import torch

from deepserve.kernels import decode_launch
from deepserve.kernels.decode_launch import decode_num_splits, launch_num_splits, merge_max_splits

CPU = torch.device("cpu")
SHAPES = {"1b": (8, 64, 4), "8b": (8, 128, 4), "qwen3-moe": (4, 128, 8)}     # KV heads, head_dim, group


@pytest.fixture(autouse=True)
def h100_sms(monkeypatch):
    monkeypatch.setattr(decode_launch, "num_sms", lambda device: 132)
    monkeypatch.setattr(decode_launch, "SPLIT_RULE", "merged")


def splits(shape: str, batch: int, context: int, merge: bool = True) -> int:
    hkv, d, group = SHAPES[shape]
    return decode_num_splits(batch, hkv, context, CPU, d, group if merge else 0)


def test_merge_max_splits_is_the_merge_tiles_limit():
    assert merge_max_splits(4, 64) == 16 and merge_max_splits(4, 128) == 8 and merge_max_splits(8, 128) == 4
    assert merge_max_splits(3, 64) == 16                 # heads pad to a power of two
    assert merge_max_splits(4, 96) == 0                  # partials packed at a power-of-two head width only
    for heads, d in ((4, 64), (4, 128), (8, 128), (16, 128)):
        most = merge_max_splits(heads, d)
        assert decode_launch.merge_tile(heads, most, d) is not None
        assert decode_launch.merge_tile(heads, most + 1, d) is None


def test_reduce_launches_keep_session_42s_counts():
    # Without the in-kernel merge: four programs an SM of at least 128 keys, none past the one-wave line.
    assert splits("1b", 1, 1024, merge=False) == 8
    assert splits("1b", 1, 4096, merge=False) == 32
    assert splits("8b", 1, 1024, merge=False) == 8
    assert splits("qwen3-moe", 32, 4096, merge=False) == 5
    assert splits("1b", 64, 1024, merge=False) == 1
    assert splits("8b", 32, 4096, merge=False) == 1


def test_one_tile_partitions_where_the_merge_holds_them():
    assert splits("1b", 1, 1024) == 16            # 64 keys a split: 4.74 us against 8 splits' 5.54
    assert splits("1b", 2, 1024) == 16
    assert splits("1b", 1, 100) == 2              # short contexts split too: a tile each
    assert splits("1b", 8, 1024) == 9             # four programs an SM come first (the launch's 128-key tiles: 8)
    assert splits("8b", 1, 1024) == 8             # 16 would take the reduce: the merge tile's 8 (6.70 against 7.15 us)


def test_the_merge_tiles_count_where_the_rule_asks_for_a_few_more():
    assert splits("qwen3-moe", 32, 4096) == 4     # not 5 (a reduce): 56.5 against 62.5 us over E4M3
    assert splits("8b", 8, 4096) == 8             # 9 -> 8
    # Far past the tile the reduce launch stays: 32 splits beat the merge's 16 at batch 1 and 4k (7.25 / 7.82 us).
    assert splits("1b", 1, 4096) == 32
    assert splits("8b", 1, 4096) == 32


def test_no_split_past_the_one_wave_line():
    # 2 splits were faster at kernel level there, not in decode steps (Llama-3.2-1B batch 64), either PDL trigger.
    assert splits("1b", 64, 1024) == 1 and splits("8b", 32, 4096) == 1 and splits("qwen3-moe", 64, 1024) == 1
    assert splits("1b", 32, 1024) == 3            # just below it


def test_the_reduce_rule_setting_restores_session_42s_counts(monkeypatch):
    monkeypatch.setattr(decode_launch, "SPLIT_RULE", "reduce")
    assert splits("1b", 1, 1024) == 8 and splits("1b", 64, 1024) == 1 and splits("qwen3-moe", 32, 4096) == 5


def test_launch_num_splits_reads_the_cache_and_the_merge():
    cache = torch.empty(2, 4, 16, 8, 64, dtype=torch.bfloat16)          # Llama-3.2-1B's KV heads
    assert launch_num_splits(1, 32, cache, 1024, merging=True) == 16
    assert launch_num_splits(1, 32, cache, 1024, merging=False) == 8
    assert launch_num_splits(2, 32, cache.to(torch.float8_e4m3fn), 1024, merging=True) == 16
    qwen3 = torch.empty(2, 4, 16, 4, 128, dtype=torch.bfloat16)        # group 8: the merge holds 4 splits
    assert launch_num_splits(32, 32, qwen3, 4096, merging=True) == 4
    assert launch_num_splits(32, 32, qwen3, 4096, merging=False) == 5


def test_one_tile_merge_takes_one_tile_partitions_past_the_tile(monkeypatch):
    """DEEPSERVE_DECODE_MERGE_ONE_TILE: one-tile partitions up to twice the merge tile's count (a graph sized for
    1100 keys: 18 splits of the 1B at batch 1-2), merged over a tile twice the size; nothing else moves (batch 4,
    whose four programs an SM come first at 17 splits of two tiles; batch 8; the 4k contexts; the 8B, whose 18
    one-tile splits are past even that tile)."""
    monkeypatch.setattr(decode_launch, "ONE_TILE_MERGE", False)
    moved = (("1b", 1, 1100), ("1b", 2, 1100))
    kept = (("1b", 4, 1100), ("1b", 8, 1100), ("1b", 1, 4096), ("8b", 1, 1100), ("qwen3-moe", 32, 4096))
    before = {key: splits(*key) for key in moved + kept}
    assert before[("1b", 1, 1100)] == 16 and decode_launch.merge_tile(4, 18, 64, one_tile=True) is None
    monkeypatch.setattr(decode_launch, "ONE_TILE_MERGE", True)
    after = {key: splits(*key) for key in before}
    assert [after[key] for key in moved] == [18, 18]
    assert [after[key] for key in kept] == [before[key] for key in kept]
    assert decode_launch.merge_tile(4, 18, 64, one_tile=True) == (4, 32)
    assert decode_launch.merge_tile(4, 18, 64) is None            # partitions of two tiles keep the reduce
    assert decode_launch.merge_tile(4, 33, 64, one_tile=True) is None
    # Only the 64-wide heads it was timed on: the 8B's 16 one-tile splits at 1k would fit the doubled tile.
    assert splits("8b", 1, 1024) == 8 and decode_launch.merge_tile(4, 16, 128, one_tile=True) is None
