"""Paged KV blocks: ref counts, copy-on-write, and automatic prefix caching.

The KV cache is cut into `num_blocks` blocks of `block_size` token slots. A sequence owns a block
table (a list of block ids); token i of the sequence lives in slot `block_table[i // bs] * bs + i % bs`.

Prefix caching: once a block is full and its KV computed, it is named by a chained hash
`h_i = H(h_{i-1}, tokens of block i)`, so equal hashes mean equal whole prefixes. A new sequence
reuses the longest run of cached blocks matching its prefix. Blocks whose ref count drops to 0 go to
the tail of the free queue *keeping* their hash, so they can still be hit; allocation takes from the
head (least recently freed) and only then forgets the hash (LRU eviction).

Invariants (checked by tests/engine/test_block_manager.py):
- ref_count of a block == number of block-table entries that name it;
- a block is in the free queue iff its ref_count == 0, so no block is ever handed out twice;
- `cached[h] == b` implies `blocks[b].block_hash == h`.

KV store hooks (engine/kv_store_connector.py): `evict_hook(block_id, hash)` runs just before a named block's
content is given up (its KV is still intact then); `import_block` names a free block for KV loaded from the store,
pinned (ref count 1, out of the free queue) until `unpin`, so the invariants above hold throughout.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from deepserve.sequence import Sequence


class NoFreeBlocksError(RuntimeError):
    pass


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None


def hash_block(parent_hash: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """Chained content hash of one full block (collision-resistant: a hit reuses KV blindly)."""
    h = hashlib.blake2b(digest_size=16)
    if parent_hash is not None:
        h.update(parent_hash)
    h.update(b"".join(t.to_bytes(4, "little", signed=False) for t in token_ids))
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        # Copy-on-write copies (src, dst) the model runner must do before the next forward.
        self.pending_copies: list[tuple[int, int]] = []
        # Chained hashes of each sequence's full blocks, by seq_id (tokens never change, only grow).
        self._seq_hashes: dict[int, list[bytes]] = {}
        self._num_named: dict[int, int] = {}    # seq_id -> leading full blocks already named in `cached`
        self.prefix_queries = 0     # tokens looked up in the prefix cache
        self.prefix_hits = 0        # of those, tokens found
        self.evict_hook: Callable[[int, bytes], None] | None = None

    # --- accounting ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix cache -------------------------------------------------------------------------
    def block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        """Hashes of the first `num_full_blocks` full blocks of `seq` (memoised per sequence)."""
        hashes = self._seq_hashes.setdefault(seq.seq_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(hash_block(hashes[-1] if hashes else None, seq.token_ids[i * bs:(i + 1) * bs]))
        return hashes[:num_full_blocks]

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of `seq`.

        At least one token is always left to compute: the forward pass over it yields the logits
        the next token is sampled from.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for h in self.block_hashes(seq, max_blocks):
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_query_tokens
        self.prefix_hits += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Name the sequence's newly completed blocks so later sequences can reuse them."""
        if not self.enable_prefix_caching:
            return
        # Only blocks whose token ids are all known (an in-flight token's id has not reached the host yet).
        known = min(seq.num_computed_tokens, len(seq.token_ids))
        num_full = min(known // self.block_size, len(seq.block_table))
        named = self._num_named.get(seq.seq_id, 0)
        if num_full <= named:
            return      # most steps of a decode complete no block: nothing to hash
        hashes = self.block_hashes(seq, num_full)
        self._num_named[seq.seq_id] = num_full
        for i in range(named, num_full):
            h, block = hashes[i], self.blocks[seq.block_table[i]]
            if block.block_hash is not None or h in self.cached:
                continue  # already named, or the same content lives in another block
            block.block_hash = h
            self.cached[h] = block.block_id

    # --- allocation ---------------------------------------------------------------------------
    def num_blocks_to_allocate(self, seq: Sequence, num_new_tokens: int, num_cached_blocks: int = 0,
                               num_lookahead_tokens: int = 0) -> int:
        have = max(len(seq.block_table), num_cached_blocks)
        computed = max(seq.num_computed_tokens, num_cached_blocks * self.block_size)
        need = self.blocks_for_tokens(computed + num_new_tokens + num_lookahead_tokens) - have
        return max(need, 0) + int(self._needs_copy_on_write(seq))

    def fits_in_place(self, seq: Sequence, num_new_tokens: int) -> bool:
        """The sequence's blocks already hold `num_new_tokens` more tokens and none needs a copy-on-write:
        `num_blocks_to_allocate(seq, n) == 0`, decided with a few integer operations (the common decode step)."""
        computed, bs = seq.num_computed_tokens, self.block_size
        if computed + num_new_tokens > len(seq.block_table) * bs:
            return False
        return computed % bs == 0 or self.blocks[seq.block_table[computed // bs]].ref_count == 1

    def admission_cost(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int],
                       num_lookahead_tokens: int = 0) -> int:
        """Free blocks consumed by admitting `seq`: new blocks plus cache hits now in the free queue."""
        revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        return revived + self.num_blocks_to_allocate(seq, num_new_tokens, len(cached_blocks), num_lookahead_tokens)

    def can_allocate(self, num_blocks: int, reserve: int = 0) -> bool:
        return self.num_free_blocks - num_blocks >= reserve

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | None = None,
                       num_lookahead_tokens: int = 0) -> None:
        """Give `seq` slots for `num_new_tokens` more tokens (plus lookahead for draft tokens).

        `cached_blocks` (only for a sequence holding no blocks yet) are prefix-cache hits to adopt.
        The caller checks `can_allocate` first; running out here is a bug, hence an exception.
        """
        if cached_blocks:
            assert not seq.block_table, "prefix hits are adopted only by a sequence without blocks"
            for block_id in cached_blocks:
                self._take(block_id)
            seq.block_table = list(cached_blocks)
            seq.num_computed_tokens = len(cached_blocks) * self.block_size
        needed = self.num_blocks_to_allocate(seq, num_new_tokens, 0, num_lookahead_tokens)
        if needed > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {needed} blocks, {self.num_free_blocks} free")
        if self._needs_copy_on_write(seq):
            self._copy_on_write(seq)
            needed -= 1
        for _ in range(needed):
            seq.block_table.append(self._pop_free())

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks. Tail blocks are queued first so they are evicted first:
        a shared prefix outlives the private suffix behind it."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        self._num_named.pop(seq.seq_id, None)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past the ones holding the sequence's computed tokens (after rejected drafts), tail first."""
        keep = self.blocks_for_tokens(seq.num_computed_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def forget(self, seq: Sequence) -> None:
        """Drop per-sequence memo once the sequence is gone for good."""
        self._seq_hashes.pop(seq.seq_id, None)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share all of the parent's blocks with `child`; the partial last block is copied on write."""
        assert not child.block_table
        for block_id in parent.block_table:
            self._take(block_id)
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # --- KV store -----------------------------------------------------------------------------
    def named_blocks(self, seq: Sequence) -> list[tuple[bytes, int]]:
        """(hash, block id) of the sequence's leading full blocks whose KV is computed and whose tokens are known:
        the ones a KV store may keep."""
        num = self._num_named.get(seq.seq_id, 0)
        return list(zip(self.block_hashes(seq, num), seq.block_table[:num]))

    def import_block(self, block_hash: bytes) -> int:
        """A free block named `block_hash`, for KV the caller writes into it now; pinned until `unpin`."""
        assert block_hash not in self.cached, "the block is in the device cache already"
        block_id = self._pop_free()
        self.blocks[block_id].block_hash = block_hash
        self.cached[block_hash] = block_id
        return block_id

    def pin(self, block_ids: list[int]) -> None:
        """Hold blocks (one reference each) so that no allocation evicts them meanwhile."""
        for block_id in block_ids:
            self._take(block_id)

    def unpin(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self._release(block_id)

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()

    # --- internals ----------------------------------------------------------------------------
    def _needs_copy_on_write(self, seq: Sequence) -> bool:
        """The next token is written into a partially filled block that someone else also holds."""
        index, offset = divmod(seq.num_computed_tokens, self.block_size)
        return offset != 0 and index < len(seq.block_table) and self.blocks[seq.block_table[index]].ref_count > 1

    def _copy_on_write(self, seq: Sequence) -> None:
        index = seq.num_computed_tokens // self.block_size
        src = seq.block_table[index]
        dst = self._pop_free()
        self._release(src)
        seq.block_table[index] = dst
        self.pending_copies.append((src, dst))

    def _pop_free(self) -> int:
        if not self.free_queue:
            raise NoFreeBlocksError("no free KV blocks")
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:           # evict: its content is about to be overwritten
            if self.evict_hook is not None:
                self.evict_hook(block_id, block.block_hash)
            del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block_id] = None
