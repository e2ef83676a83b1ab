"""BlockManager: unit checks and a stateful property test of its invariants."""

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from deepserve.engine.block_manager import BlockManager, NoFreeBlocksError, hash_block
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


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / compute / fork / free / evict sequences; the invariants must always hold."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(12, BS)
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
        if self.bm.can_allocate(self.bm.admission_cost(seq, n, hits)):
            before_free = set(self.bm.free_queue)
            self.bm.allocate_slots(seq, n, hits)
            new_blocks = [b for b in seq.block_table if b not in hits]
            assert all(b in before_free for b in new_blocks), "handed out a block that was in use"
            seq.num_computed_tokens = len(tokens)
            self.bm.cache_full_blocks(seq)
            self.live.append(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data, token):
        seq = data.draw(st.sampled_from(self.live))
        seq.append_token(token)
        if self.bm.can_allocate(self.bm.num_blocks_to_allocate(seq, 1)):
            compute(self.bm, seq, 1)
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


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_block_manager_state_machine = BlockManagerMachine.TestCase
