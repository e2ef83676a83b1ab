"""Paged KV blocks: ref counts, copy-on-write, and automatic prefix caching; a second pool for window states.

The KV cache is cut into `num_blocks` blocks of `block_size` token slots. A sequence owns a block
table (a list of block ids); token i of the sequence lives in slot `block_table[i // bs] * bs + i % bs`.

Prefix caching: once a block is full and its KV computed, it is named by a chained hash
`h_i = H(h_{i-1}, tokens of block i)`, so equal hashes mean equal whole prefixes. A new sequence
reuses the longest run of cached blocks matching its prefix. Blocks whose ref count drops to 0 go to
the tail of the free queue *keeping* their hash, so they can still be hit; allocation takes from the
head (least recently freed) and only then forgets the hash (LRU eviction).

The window pool (models whose per-position states are read only `reach` positions back: DeepSeek-V4 / V4.1's
sliding-window keys, compressor states, Engram token ids and DSpark main keys; layers/paged_state.py): a second
`BlockPool` of the same block size. `seq.window_table[i]` is the window block of the sequence's block i, allocated,
copied on write and trimmed with it, and released (-1) once no row can read it again: when all its positions lie
more than `reach` behind the sequence's next one (`release_window`, after each step). A sequence so holds about
ceil(reach / bs) + 1 window blocks between steps (a prompt chunk one per bs of its tokens while it runs): DeepInfer's
per-sequence SWA ring of W + BT slots (§2.11), kept at block granularity so that prefix caching stays exact.
Released window blocks keep their hash like any freed block, and a prefix hit of k blocks is taken only where the
window blocks a row at position k·bs reads (`_window_range(k)`) are cached too; otherwise the hit is shortened. A
window block is named only if every layer wrote its positions (`seq.window_complete_from`: YOCO's prompt steps skip
consumer-layer rows before the kept suffix), so a hit never reads states nobody wrote.

Invariants (checked by tests/engine/test_block_manager.py), for each pool:
- ref_count of a block == number of table entries that name it (block tables, window tables);
- a block is in the free queue iff its ref_count == 0, so no block is ever handed out twice;
- `cached[h] == b` implies `blocks[b].block_hash == h`;
- a window table is as long as its block table, and its released (-1) entries are a prefix of it.

KV store hooks (engine/kv_store_connector.py): `evict_hook(block_id, hash)` runs just before a named block's
content is given up (its KV is still intact then); `import_block` names a free block for KV loaded from the store,
pinned (ref count 1, out of the free queue) until `unpin`, so the invariants above hold throughout. (A model with a
window pool is not storable: the runner says so.)
"""

from __future__ import annotations

import hashlib
import struct
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


@dataclass(frozen=True)
class WindowPool:
    """The window pool's size, and how far back (positions before a row's own) a row reads its window states."""
    num_blocks: int
    reach: int


def hash_block(parent_hash: bytes | None, token_ids: list[int] | tuple[int, ...]) -> bytes:
    """Chained content hash of one full block (collision-resistant: a hit reuses KV blindly)."""
    h = hashlib.blake2b(digest_size=16)
    if parent_hash is not None:
        h.update(parent_hash)
    # Each id as 4 little-endian unsigned bytes; struct packs the block in one call (5x a to_bytes per token).
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()


class BlockPool:
    """The blocks of one cache: ref counts, the LRU free queue, named (hashed) blocks, pending copy-on-write copies."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        self.pending_copies: list[tuple[int, int]] = []      # (src, dst) for the model runner, before the forward
        self.evict_hook: Callable[[int, bytes], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def pop_free(self) -> int:
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

    def take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"block {block_id} freed twice"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_queue[block_id] = None

    def name(self, block_id: int, block_hash: bytes) -> None:
        """Make a full block a prefix-cache entry, unless it is named already or the same content lives elsewhere."""
        block = self.blocks[block_id]
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block_id

    def revived(self, block_ids) -> int:
        """How many of these (cached) blocks sit in the free queue: adopting them takes free blocks."""
        return sum(1 for b in block_ids if self.blocks[b].ref_count == 0)

    def copy_on_write(self, table: list[int], index: int) -> None:
        src = table[index]
        dst = self.pop_free()
        self.release(src)
        table[index] = dst
        self.pending_copies.append((src, dst))

    def shared(self, block_id: int) -> bool:
        return self.blocks[block_id].ref_count > 1

    def forget_names(self) -> None:
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 window: WindowPool | None = None) -> None:
        self.pool = BlockPool(num_blocks)
        self.window = BlockPool(window.num_blocks) if window is not None else None
        self.window_reach = window.reach if window is not None else 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # The main pool's parts under their old names (the KV store connector and tests read them).
        self.blocks, self.free_queue, self.cached = self.pool.blocks, self.pool.free_queue, self.pool.cached
        # Chained hashes of each sequence's full blocks, by seq_id (tokens never change, only grow).
        self._seq_hashes: dict[int, list[bytes]] = {}
        self._num_named: dict[int, int] = {}    # seq_id -> leading full blocks already named in `cached`
        self.prefix_queries = 0     # tokens looked up in the prefix cache
        self.prefix_hits = 0        # of those, tokens found

    @property
    def evict_hook(self) -> Callable[[int, bytes], None] | None:
        return self.pool.evict_hook

    @evict_hook.setter
    def evict_hook(self, hook: Callable[[int, bytes], None] | None) -> None:
        self.pool.evict_hook = hook

    # --- accounting ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_window_blocks(self) -> int:
        return self.window.num_blocks if self.window is not None else 0

    @property
    def num_free_window_blocks(self) -> int:
        return self.window.num_free if self.window is not None else 0

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
        """Block ids holding the longest cached prefix of `seq` (with a window pool: whose window blocks before the
        hit point are cached too).

        At least one token is always left to compute: the forward pass over it yields the logits
        the next token is sampled from.
        """
        if not self.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self.block_hashes(seq, max_blocks)
        hits: list[int] = []
        for h in hashes:
            block_id = self.cached.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        if self.window is not None:
            while hits and not all(hashes[i] in self.window.cached for i in self._window_range(len(hits))):
                hits.pop()
        return hits

    def _window_range(self, num_blocks: int) -> range:
        """Block indices of the window blocks a row at position num_blocks·bs reads (positions >= it - reach)."""
        first = max(0, num_blocks * self.block_size - self.window_reach) // self.block_size
        return range(first, num_blocks)

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_query_tokens
        self.prefix_hits += num_hit_tokens

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Name the sequence's newly completed blocks (and their window blocks) so later sequences can reuse them."""
        if not self.enable_prefix_caching:
            return
        # Only blocks whose token ids are all known (an in-flight token's id has not reached the host yet), and that
        # the sequence holds: min(known tokens, table slots) // block_size, in one min() (this runs every step).
        bs = self.block_size
        num_full = min(seq.num_computed_tokens, len(seq.token_ids), len(seq.block_table) * bs) // bs
        named = self._num_named.get(seq.seq_id, 0)
        if num_full <= named:
            return      # most steps of a decode complete no block: nothing to hash
        hashes = self.block_hashes(seq, num_full)
        self._num_named[seq.seq_id] = num_full
        for i in range(named, num_full):
            self.pool.name(seq.block_table[i], hashes[i])
            if self.window is not None and seq.window_table[i] >= 0 and i * self.block_size >= seq.window_complete_from:
                self.window.name(seq.window_table[i], hashes[i])

    # --- allocation ---------------------------------------------------------------------------
    def _new_entries(self, seq: Sequence, num_new_tokens: int, num_cached_blocks: int,
                     num_lookahead_tokens: int) -> int:
        """Table entries (a block, and a window block) the sequence must gain for that many more tokens."""
        have = max(len(seq.block_table), num_cached_blocks)
        computed = max(seq.num_computed_tokens, num_cached_blocks * self.block_size)
        return max(self.blocks_for_tokens(computed + num_new_tokens + num_lookahead_tokens) - have, 0)

    def num_blocks_to_allocate(self, seq: Sequence, num_new_tokens: int, num_cached_blocks: int = 0,
                               num_lookahead_tokens: int = 0) -> int:
        return (self._new_entries(seq, num_new_tokens, num_cached_blocks, num_lookahead_tokens)
                + int(self._needs_copy_on_write(seq, self.pool, seq.block_table)))

    def num_window_blocks_to_allocate(self, seq: Sequence, num_new_tokens: int, num_cached_blocks: int = 0,
                                      num_lookahead_tokens: int = 0) -> int:
        if self.window is None:
            return 0
        return (self._new_entries(seq, num_new_tokens, num_cached_blocks, num_lookahead_tokens)
                + int(self._needs_copy_on_write(seq, self.window, seq.window_table)))

    def fits_in_place(self, seq: Sequence, num_new_tokens: int) -> bool:
        """The sequence's blocks already hold `num_new_tokens` more tokens and none needs a copy-on-write:
        `num_blocks_to_allocate(seq, n) == 0`, decided with a few integer operations (the common decode step)."""
        computed, bs = seq.num_computed_tokens, self.block_size
        if computed + num_new_tokens > len(seq.block_table) * bs:
            return False
        if computed % bs == 0:
            return True
        index = computed // bs
        return not self.pool.shared(seq.block_table[index]) and \
            (self.window is None or not self.window.shared(seq.window_table[index]))

    def admission_cost(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int],
                       num_lookahead_tokens: int = 0) -> int:
        """Free blocks consumed by admitting `seq`: new blocks plus cache hits now in the free queue."""
        return self.pool.revived(cached_blocks) + self.num_blocks_to_allocate(seq, num_new_tokens, len(cached_blocks),
                                                                              num_lookahead_tokens)

    def window_admission_cost(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int],
                              num_lookahead_tokens: int = 0) -> int:
        """Free window blocks consumed by admitting `seq`: new ones plus the window hits now in the free queue."""
        if self.window is None:
            return 0
        k = len(cached_blocks)
        hashes = self.block_hashes(seq, k)
        hits = [self.window.cached[hashes[i]] for i in self._window_range(k)]
        return self.window.revived(hits) + self._new_entries(seq, num_new_tokens, k, num_lookahead_tokens)

    def can_allocate(self, num_blocks: int, reserve: int = 0) -> bool:
        return self.num_free_blocks - num_blocks >= reserve

    def can_admit(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int], reserve: int = 0) -> bool:
        """Both pools have room to admit `seq` with these prefix hits (`reserve` main blocks kept free)."""
        return (self.can_allocate(self.admission_cost(seq, num_new_tokens, cached_blocks), reserve)
                and self.num_free_window_blocks >= self.window_admission_cost(seq, num_new_tokens, cached_blocks))

    def can_grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Both pools have room for `num_new_tokens` more tokens of a running sequence."""
        return (self.can_allocate(self.num_blocks_to_allocate(seq, num_new_tokens))
                and self.num_free_window_blocks >= self.num_window_blocks_to_allocate(seq, num_new_tokens))

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] | None = None,
                       num_lookahead_tokens: int = 0) -> None:
        """Give `seq` slots for `num_new_tokens` more tokens (plus lookahead for draft tokens).

        `cached_blocks` (only for a sequence holding no blocks yet) are prefix-cache hits to adopt (from
        `find_cached_prefix`, in the same scheduling pass: their window blocks are cached).
        The caller checks `can_admit` / `can_grow` first; running out here is a bug, hence an exception.
        """
        if cached_blocks:
            self._adopt(seq, cached_blocks)
        needed = self._new_entries(seq, num_new_tokens, 0, num_lookahead_tokens)
        cow = self._needs_copy_on_write(seq, self.pool, seq.block_table)
        if needed + cow > self.num_free_blocks:
            raise NoFreeBlocksError(f"need {needed + cow} blocks, {self.num_free_blocks} free")
        window_cow = self.window is not None and self._needs_copy_on_write(seq, self.window, seq.window_table)
        if self.window is not None and needed + window_cow > self.window.num_free:
            raise NoFreeBlocksError(f"need {needed + window_cow} window blocks, {self.window.num_free} free")
        index = seq.num_computed_tokens // self.block_size
        if cow:
            self.pool.copy_on_write(seq.block_table, index)
        if window_cow:
            self.window.copy_on_write(seq.window_table, index)
        for _ in range(needed):
            seq.block_table.append(self.pool.pop_free())
            if self.window is not None:
                seq.window_table.append(self.window.pop_free())

    def _adopt(self, seq: Sequence, cached_blocks: list[int]) -> None:
        assert not seq.block_table, "prefix hits are adopted only by a sequence without blocks"
        for block_id in cached_blocks:
            self.pool.take(block_id)
        seq.block_table = list(cached_blocks)
        k = len(cached_blocks)
        seq.num_computed_tokens = k * self.block_size
        if self.window is not None:
            hashes, window = self.block_hashes(seq, k), self._window_range(k)
            seq.window_table = [-1] * window.start + [self.window.cached[hashes[i]] for i in window]
            for i in window:
                self.window.take(seq.window_table[i])
            seq.num_window_released = window.start

    def release_window(self, seq: Sequence) -> None:
        """Give back the window blocks no later row of `seq` reads: those wholly before its next position - reach.
        (Run after a step's rewind: rejected drafts move the next position back.) They keep their names."""
        if self.window is None:
            return
        first_read = max(0, seq.num_computed_tokens - self.window_reach) // self.block_size
        end = min(first_read, len(seq.window_table))
        for i in range(seq.num_window_released, end):
            self.window.release(seq.window_table[i])
            seq.window_table[i] = -1
        seq.num_window_released = max(seq.num_window_released, end)

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks. Tail blocks are queued first so they are evicted first:
        a shared prefix outlives the private suffix behind it."""
        for block_id in reversed(seq.block_table):
            self.pool.release(block_id)
        for block_id in reversed(seq.window_table):
            if block_id >= 0:
                self.window.release(block_id)
        self._num_named.pop(seq.seq_id, None)
        seq.block_table, seq.window_table, seq.num_window_released = [], [], 0
        seq.num_computed_tokens = 0

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past the ones holding the sequence's computed tokens (after rejected drafts), tail first."""
        keep = self.blocks_for_tokens(seq.num_computed_tokens)
        while len(seq.block_table) > keep:
            self.pool.release(seq.block_table.pop())
            if self.window is not None:
                self.window.release(seq.window_table.pop())

    def forget(self, seq: Sequence) -> None:
        """Drop per-sequence memo once the sequence is gone for good."""
        self._seq_hashes.pop(seq.seq_id, None)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share all of the parent's blocks with `child`; the partial last block is copied on write."""
        assert not child.block_table
        for block_id in parent.block_table:
            self.pool.take(block_id)
        for block_id in parent.window_table:
            if block_id >= 0:
                self.window.take(block_id)
        child.block_table, child.window_table = list(parent.block_table), list(parent.window_table)
        child.num_window_released = parent.num_window_released
        child.num_computed_tokens = parent.num_computed_tokens

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self.pool.pending_copies = self.pool.pending_copies, []
        return copies

    def take_pending_window_copies(self) -> list[tuple[int, int]]:
        if self.window is None:
            return []
        copies, self.window.pending_copies = self.window.pending_copies, []
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
        block_id = self.pool.pop_free()
        self.pool.name(block_id, block_hash)
        return block_id

    def pin(self, block_ids: list[int]) -> None:
        """Hold blocks (one reference each) so that no allocation evicts them meanwhile."""
        for block_id in block_ids:
            self.pool.take(block_id)

    def unpin(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            self.pool.release(block_id)

    def reset_prefix_cache(self) -> None:
        self.pool.forget_names()
        if self.window is not None:
            self.window.forget_names()

    # --- internals ----------------------------------------------------------------------------
    def _needs_copy_on_write(self, seq: Sequence, pool: BlockPool, table: list[int]) -> bool:
        """The next token is written into a partially filled block that someone else also holds."""
        index, offset = divmod(seq.num_computed_tokens, self.block_size)
        return offset != 0 and index < len(table) and pool.shared(table[index])
