"""BlockManager: unit checks and a stateful property test of its invariants."""

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from deepserve.engine.block_manager import BlockManager, NoFreeBlocksError, WindowPool, hash_block
from deepserve.sequence import Sequence
from deepserve.sampling_params import SamplingParams

BS = 4


def make_seq(seq_id, tokens):
    return Sequence(seq_id, str(seq_id), 0, tokens, SamplingParams(), seed=0)


def compute(bm, seq, n):
    """What the scheduler does for a step: slots for n tokens, then (after the forward) cache blocks."""
    bm.allocate_slots(seq, n)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)


def test_prefix_hit_reuses_blocks_and_leaves_one_token():
    bm = BlockManager(16, BS)
    a = make_seq(1, list(range(10)))
    compute(bm, a, 10)
    b = make_seq(2, list(range(8)) + [99, 98, 97])
    hits = bm.find_cached_prefix(b)
    assert hits == a.block_table[:2]
    # Exactly a block multiple: the last block is not reused, the last token must be computed.
    c = make_seq(3, list(range(8)))
    assert bm.find_cached_prefix(c) == a.block_table[:1]


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(4, BS)
    a = make_seq(1, list(range(9)))
    compute(bm, a, 9)                       # 3 blocks, 2 full
    bm.free(a)
    assert bm.num_free_blocks == 4
    again = make_seq(2, list(range(9)))
    assert len(bm.find_cached_prefix(again)) == 2
    # Allocating all blocks evicts them.
    hog = make_seq(3, [7] * 16)
    bm.allocate_slots(hog, 16)
    assert bm.find_cached_prefix(again) == [] and not bm.cached


def test_can_allocate_counts_revived_cache_hits():
    bm = BlockManager(3, BS)
    a = make_seq(1, list(range(9)))
    compute(bm, a, 9)
    bm.free(a)
    b = make_seq(2, list(range(9)))
    hits = bm.find_cached_prefix(b)
    cost = bm.admission_cost(b, 9 - len(hits) * BS, hits)
    assert cost == 3                        # 2 revived + 1 new
    bm.allocate_slots(b, 1, hits)
    assert b.num_computed_tokens == 8 and bm.num_free_blocks == 0


def test_copy_on_write_of_shared_partial_block():
    bm = BlockManager(8, BS)
    parent = make_seq(1, list(range(6)))
    compute(bm, parent, 6)
    child = make_seq(2, list(range(6)))
    bm.fork(parent, child)
    child.append_token(50)
    assert bm.num_blocks_to_allocate(child, 1) == 1
    bm.allocate_slots(child, 1)
    copies = bm.take_pending_copies()
    assert len(copies) == 1 and copies[0][0] == parent.block_table[1]
    assert child.block_table[0] == parent.block_table[0] and child.block_table[1] != parent.block_table[1]


def test_running_out_raises():
    bm = BlockManager(2, BS)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate_slots(make_seq(1, list(range(12))), 12)


def test_hash_chains_include_parent():
    assert hash_block(None, [1, 2]) != hash_block(hash_block(None, [0]), [1, 2])


# --- the window pool -------------------------------------------------------------------------------------------------

def test_window_blocks_follow_the_table_and_are_released_behind_the_reach():
    """Reach 5, blocks of 4: after computing 14 tokens the next row (position 14) reads positions >= 9, block 2 on:
    blocks 0 and 1 go back; the main blocks stay."""
    bm = BlockManager(16, BS, window=WindowPool(16, reach=5))
    seq = make_seq(1, list(range(14)))
    compute(bm, seq, 14)
    assert len(seq.window_table) == len(seq.block_table) == 4
    bm.release_window(seq)
    assert seq.window_table[:2] == [-1, -1] and min(seq.window_table[2:]) >= 0
    assert bm.num_free_window_blocks == 14 and bm.num_free_blocks == 12
    bm.release_window(seq)                          # idempotent
    assert bm.num_free_window_blocks == 14
    bm.free(seq)
    assert bm.num_free_window_blocks == 16 and bm.num_free_blocks == 16


def test_a_prefix_hit_needs_the_window_blocks_before_its_hit_point():
    """A hit of k blocks is exact only if the window blocks a row at position k·bs reads are cached: reach 5 at k = 3
    (position 12 reads >= 7) needs window blocks 1 and 2. Once window blocks 0 and 1 are evicted, no shorter hit
    works either (k = 2 needs windows 0-1, k = 1 window 0): the main blocks alone are no hit."""
    bm = BlockManager(16, BS, window=WindowPool(4, reach=5))
    a = make_seq(1, list(range(14)))
    compute(bm, a, 14)
    bm.release_window(a)                           # window blocks 0, 1 back in the free queue, still named
    b = make_seq(2, list(range(13)) + [77])
    assert bm.find_cached_prefix(b) == a.block_table[:3]
    assert bm.window_admission_cost(b, 2, a.block_table[:3]) == 1 + 1     # window block 1 revived + 1 new
    bm.free(a)
    # Evict window block 1 (a's released block): 2 allocations take the free queue's head, a's blocks 0 then 1.
    hog = make_seq(3, [5] * 8)
    bm.allocate_slots(hog, 8)
    assert bm.find_cached_prefix(b) == []
    assert all(h in bm.cached for h in bm.block_hashes(b, 3))          # the main blocks are still named


def test_admission_with_a_hit_adopts_the_window_blocks_and_allocates_the_rest():
    bm = BlockManager(16, BS, window=WindowPool(8, reach=5))
    a = make_seq(1, list(range(14)))
    compute(bm, a, 14)
    b = make_seq(2, list(range(13)) + [77])
    hits = bm.find_cached_prefix(b)
    assert bm.can_admit(b, 2, hits)
    bm.allocate_slots(b, 2, hits)
    assert b.num_computed_tokens == 12 and b.block_table[:3] == a.block_table[:3]
    assert b.window_table[0] == -1 and b.window_table[1:3] == a.window_table[1:3] and b.num_window_released == 1
    assert b.window_table[3] not in a.window_table and len(b.window_table) == 4
    bm.free(a)
    bm.free(b)
    assert bm.num_free_window_blocks == 8 and bm.num_free_blocks == 16


def test_the_window_pool_limits_admission_and_growth():
    bm = BlockManager(64, BS, window=WindowPool(3, reach=5))
    a = make_seq(1, list(range(12)))
    assert bm.can_admit(a, 12, []) and not bm.can_admit(make_seq(2, list(range(13))), 13, [])
    compute(bm, a, 12)
    a.append_token(1)
    assert not bm.can_grow(a, 1)                   # a 4th window block: none free
    bm.release_window(a)                           # the next row (12) reads >= 7: block 0 goes back
    assert bm.can_grow(a, 1)


def test_copy_on_write_and_trim_reach_the_window_table():
    bm = BlockManager(8, BS, window=WindowPool(8, reach=5))
    parent = make_seq(1, list(range(6)))
    compute(bm, parent, 6)
    child = make_seq(2, list(range(6)))
    bm.fork(parent, child)
    child.append_token(50)
    assert bm.num_window_blocks_to_allocate(child, 1) == 1 and not bm.fits_in_place(child, 1)
    bm.allocate_slots(child, 1)
    (src, dst), = bm.take_pending_window_copies()
    assert src == parent.window_table[1] and child.window_table[1] == dst != src
    assert child.window_table[0] == parent.window_table[0]
    bm.allocate_slots(child, 4)                    # a drafts' worth: a third block
    assert len(child.window_table) == 3
    bm.trim(child)                                 # 6 computed: back to 2 blocks in both tables
    assert len(child.window_table) == len(child.block_table) == 2


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / compute / fork / free / evict sequences; the invariants must always hold."""

    window: WindowPool | None = None

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(12, BS, window=self.window)
        self.live: list[Sequence] = []
        self.next_id = 0
        self.stored: set[bytes] = set()     # a KV store fed by the eviction hook (engine/kv_store_connector.py)
        self.bm.evict_hook = self._on_evict

    def _on_evict(self, block_id, block_hash):
        block = self.bm.blocks[block_id]
        # Run before the content is given up: still named, cached, and nobody's.
        assert block.block_hash == block_hash and self.bm.cached[block_hash] == block_id and block.ref_count == 0
        self.stored.add(block_hash)

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=20))
    def admit(self, tokens):
        seq = make_seq(self._new_id(), tokens)
        hits = self.bm.find_cached_prefix(seq)
        n = len(tokens) - len(hits) * BS
        if self.bm.can_admit(seq, n, hits):
            before_free = set(self.bm.free_queue)
            before_window = set(self.bm.window.free_queue) if self.bm.window is not None else set()
            self.bm.allocate_slots(seq, n, hits)
            new_blocks = [b for b in seq.block_table if b not in hits]
            assert all(b in before_free for b in new_blocks), "handed out a block that was in use"
            new_window = seq.window_table[len(hits):]
            assert all(b in before_window for b in new_window), "handed out a window block that was in use"
            seq.num_computed_tokens = len(tokens)
            self.bm.cache_full_blocks(seq)
            self.bm.release_window(seq)
            self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data, token):
        seq = data.draw(st.sampled_from(self.live))
        seq.append_token(token)
        if self.bm.can_grow(seq, 1):
            compute(self.bm, seq, 1)
            self.bm.release_window(seq)
        else:
            seq.token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live))
        child = make_seq(self._new_id(), parent.token_ids)
        self.bm.fork(parent, child)
        self.live.append(child)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(self.live))
        self.live.remove(seq)
        self.bm.free(seq)
        self.bm.forget(seq)

    @precondition(lambda self: self.window is None)     # a model with a window pool is not storable
    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=20))
    def load_from_store(self, tokens):
        """What the connector does at admission: pin the hits, import the stored blocks after them, unpin."""
        probe = make_seq(self._new_id(), tokens)
        hits = self.bm.find_cached_prefix(probe)
        pinned = list(hits)
        self.bm.pin(pinned)
        for h in self.bm.block_hashes(probe, (len(tokens) - 1) // BS)[len(hits):]:
            if h in self.bm.cached:
                self.bm.pin([self.bm.cached[h]])
                pinned.append(self.bm.cached[h])
            elif h in self.stored and self.bm.num_free_blocks > 0:
                pinned.append(self.bm.import_block(h))
            else:
                break
        self.bm.unpin(pinned)
        self.bm.forget(probe)
        again = make_seq(self._new_id(), tokens)
        assert self.bm.find_cached_prefix(again) == pinned       # loaded blocks are cache hits like any other
        self.bm.forget(again)

    @rule()
    def drain_copies(self):
        self.bm.take_pending_copies()
        self.bm.take_pending_window_copies()

    @invariant()
    def ref_counts_match_tables(self):
        refs = Counter(b for seq in self.live for b in seq.block_table)
        for block in self.bm.blocks:
            assert block.ref_count == refs.get(block.block_id, 0)
            assert (block.ref_count == 0) == (block.block_id in self.bm.free_queue)

    @invariant()
    def cache_map_consistent(self):
        for h, b in self.bm.cached.items():
            assert self.bm.blocks[b].block_hash == h
        named = [b.block_id for b in self.bm.blocks if b.block_hash is not None]
        assert sorted(named) == sorted(self.bm.cached.values())

    @invariant()
    def window_pool_consistent(self):
        """Each window table is as long as its block table, its released (-1) entries a prefix, every block of the
        window pool referenced exactly as often as tables name it, and a sequence holds its blocks' windows back to
        its next row's reach."""
        window = self.bm.window
        if window is None:
            assert all(not seq.window_table for seq in self.live)
            return
        refs = Counter(b for seq in self.live for b in seq.window_table if b >= 0)
        for block in window.blocks:
            assert block.ref_count == refs.get(block.block_id, 0)
            assert (block.ref_count == 0) == (block.block_id in window.free_queue)
        for h, b in window.cached.items():
            assert window.blocks[b].block_hash == h
        for seq in self.live:
            assert len(seq.window_table) == len(seq.block_table)
            released = seq.num_window_released
            assert all(b == -1 for b in seq.window_table[:released]) and all(b >= 0 for b in seq.window_table[released:])
            first_read = max(0, seq.num_computed_tokens - self.bm.window_reach) // BS
            assert released <= first_read

    @invariant()
    def no_block_twice_in_one_table(self):
        for seq in self.live:
            assert len(set(seq.block_table)) == len(seq.block_table)

    @invariant()
    def fast_fit_check_agrees(self):
        for seq in self.live:
            for n in (1, 2, 5):
                assert self.bm.fits_in_place(seq, n) == (self.bm.num_blocks_to_allocate(seq, n) == 0)

    def teardown(self):
        for seq in self.live:
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks, "blocks leaked"
        assert self.bm.num_free_window_blocks == self.bm.num_window_blocks, "window blocks leaked"


class WindowedBlockManagerMachine(BlockManagerMachine):
    """The same, with a window pool whose reach spans more than a block (DeepSeek-V4.1's per-position states)."""
    window = WindowPool(10, reach=5)


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_block_manager_state_machine = BlockManagerMachine.TestCase
WindowedBlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_windowed_block_manager_state_machine = WindowedBlockManagerMachine.TestCase
