"""The engine's side of the KV store: which blocks are saved and when, which are loaded and where to.

Save (write-behind): a finished sequence's computed full blocks (`Scheduler.finish`, before they are freed) and a
named block the device cache evicts (`BlockManager.evict_hook`, before it is overwritten: this catches preempted
and aborted sequences' blocks). The engine thread only gathers a host copy of the blocks (a memcpy on the CPU, one
device-to-host copy per layer on a GPU); encoding, checksums and I/O run on the store's writer thread. Blocks the
store already holds (as far as this process knows) are not copied again.

Load (in the background, then at admission): on a device prefix-cache miss the scheduler asks `load_prefix`; it
starts a fetch (kvstore/fetcher.py) of the blocks after the device hits, and answers False: the sequence stays in
`waiting`, passed over while the fetch runs (the sequences behind it may be admitted, every running one keeps
decoding). The store's lookup, the reads, decoding and checksums run on the fetcher's threads into host memory; no
device block is held meanwhile. Once the fetch is done, the next `load_prefix` copies its blocks into free blocks
that the block manager names with their hashes (`import_block` + `runner.write_kv_block`: a copy per layer), the
host bytes are released, and it answers True; the scheduler's `find_cached_prefix` then finds the blocks like any
cached block, so they count as computed, in `num_cached_tokens` too.
- One fetch per prefix: a sequence whose next block another sequence's fetch reads waits for that fetch's blocks
  (n > 1 samples, requests sharing a system prompt).
- A prompt the store lacks is admitted one step later than without a store (its lookup ran off the engine
  thread); a sequence whose lookup found nothing is not asked about again until its device hits change.
- Bounded: fetches hold at most `kv_store.max_fetch_bytes` of host memory together; one that does not fit while
  others hold bytes is deferred (the sequence waits until bytes are released), one larger than the cap alone
  reads what the cap holds and the rest of the prompt is computed.
- A fetch that fails (missing, corrupt, wrong layout, a store gone away, an error) ends the run there: the rest of
  the prompt is computed; one not done after `kv_store.fetch_timeout_s` (a hung mount) is given up on, and the
  prompt computed. A sequence that finishes (abort) while its fetch runs drops it (`forget`); the worker
  stops at the next block and its bytes are released. At least one prompt token is always left to compute (the
  logits come from it), as for device hits.
- Metrics: `admission_load_s` is the engine thread's time on loads (starting fetches, copying fetched blocks in),
  `fetch_s` the fetcher threads' time (lookup, read, decode, checksum).

Block-manager invariants hold throughout: loaded blocks are pinned while written and then released to the free
queue named (ref count 0, cached), exactly the state of a cached block nobody holds; a fetched block whose place
in the prefix the device has lost meanwhile (evicted) is not imported.
"""

from __future__ import annotations

import logging
import time

from deepserve.config import EngineConfig
from deepserve.engine.block_manager import BlockManager
from deepserve.kvstore.fetcher import Fetch, Fetcher
from deepserve.kvstore.keys import entry_name, layer_layout, model_fingerprint
from deepserve.kvstore.store import KVStore
from deepserve.sequence import Sequence

logger = logging.getLogger(__name__)


class KVStoreConnector:
    def __init__(self, store: KVStore, runner, block_manager: BlockManager, fingerprint: bytes,
                 max_fetch_bytes: int = 1 << 30, fetch_timeout_s: float = 30.0) -> None:
        self.store = store
        self.runner = runner
        self.block_manager = block_manager
        self.fingerprint = fingerprint
        self.layouts = [layer_layout(layer) for layer in runner.model.attention_layers()]
        self.fetcher = Fetcher(store, self.layouts, max_fetch_bytes)
        self.fetch_timeout_s = fetch_timeout_s
        self.blocks_loaded = 0
        self.saved_on_finish = 0       # blocks queued when their sequence finished
        self.saved_on_evict = 0        # blocks queued when the device cache evicted them (preempted sequences)
        self.load_failures = 0          # fetches that stopped at a block the store said it held but could not give
        self.admission_load_s = 0.0     # engine-thread time on loads: starting fetches, copying fetched blocks in
        self.fetches = 0                # fetches started
        self.fetches_deferred = 0       # fetches that found the byte cap held by others (started again later)
        self.fetches_dropped = 0        # fetches whose sequence finished (aborted) before they were used
        self.fetches_timed_out = 0      # fetches given up after fetch_timeout_s (a hung tier): the prompt is computed
        self._fetches: dict[int, tuple[Fetch, int]] = {}    # seq_id -> (its fetch, the position it starts at)
        self._fetching: dict[bytes, int] = {}               # first block hash of a fetch in `_fetches` -> seq_id
        self._deferred: dict[int, int] = {}                 # seq_id -> blocks its deferred fetch wanted
        # seq_id -> (device hits, preemptions) when the store last lacked its next block: a waiting sequence
        # re-examined every step does not ask the store again until that changes
        self._looked_up: dict[int, tuple[int, int]] = {}

    def name(self, block_hash: bytes) -> str:
        return entry_name(self.fingerprint, block_hash)

    # --- load --------------------------------------------------------------------------------
    def load_prefix(self, seq: Sequence) -> bool:
        """Before `seq`'s prefix lookup: True when it may be admitted now (the device cache holds whatever the
        store gave for it), False while a fetch for it runs in the background (it stays waiting)."""
        if seq.params.prompt_logprobs is not None:
            return True                 # prompt logprobs need the whole prompt computed
        t0 = time.perf_counter()
        try:
            entry = self._fetches.get(seq.seq_id)
            if entry is not None:
                return self._finish_fetch(seq, *entry)
            return not self._start_fetch(seq)
        finally:
            self.admission_load_s += time.perf_counter() - t0

    def _start_fetch(self, seq: Sequence) -> bool:
        """Start a background fetch of the blocks after `seq`'s device hits, if the store may hold some;
        True when `seq` must wait for it (or for fetch bytes to be released)."""
        bm = self.block_manager
        hits = bm.find_cached_prefix(seq)
        max_blocks = (seq.num_tokens - 1) // bm.block_size     # the last token is always computed
        if len(hits) >= max_blocks or self._looked_up.get(seq.seq_id) == (len(hits), seq.num_preemptions):
            return False
        wanted = self._deferred.get(seq.seq_id)
        if wanted is not None and not self.fetcher.budget.fits(wanted, self.fetcher.block_bytes):
            return True                 # the cap is still held by other fetches
        # Room: free blocks, less the hits that leave the free queue at admission and one block for the tail.
        room = bm.num_free_blocks - sum(1 for b in hits if bm.blocks[b].ref_count == 0) - 1
        hashes = bm.block_hashes(seq, max_blocks)[len(hits):][:max(room, 0)]
        if not hashes:
            return False
        if hashes[0] in self._fetching:
            return True                 # another sequence fetches this very prefix: wait for its blocks
        self._deferred.pop(seq.seq_id, None)
        names = [None if h in bm.cached else self.name(h) for h in hashes]      # None: the device has it
        self._fetches[seq.seq_id] = (self.fetcher.submit(names), len(hits))
        self._fetching[hashes[0]] = seq.seq_id
        self.fetches += 1
        return True

    def _finish_fetch(self, seq: Sequence, fetch: Fetch, start: int) -> bool:
        """`seq`'s fetch: False while it runs or when it was deferred (it is started again once the byte cap has
        room); once done, its blocks go into the device cache and True."""
        if not fetch.done.is_set():
            if time.monotonic() - fetch.submitted < self.fetch_timeout_s:
                return False
            self._drop_fetch(seq)               # a hung tier: give up on it, compute (and do not ask again)
            fetch.cancel()
            self.fetches_timed_out += 1
            self._looked_up[seq.seq_id] = (len(self.block_manager.find_cached_prefix(seq)), seq.num_preemptions)
            return True
        self._drop_fetch(seq)
        if fetch.deferred:
            self.fetches_deferred += 1
            self._deferred[seq.seq_id] = fetch.held
            return False
        if fetch.failed:
            self.load_failures += 1
        used_all = self._install(seq, fetch, start)
        num_store_names = sum(n is not None for n in fetch.names)
        store_lacked_next = fetch.failed or (not fetch.truncated and fetch.held < num_store_names)
        if used_all and store_lacked_next:
            self._looked_up[seq.seq_id] = (len(self.block_manager.find_cached_prefix(seq)), seq.num_preemptions)
        return True

    def _install(self, seq: Sequence, fetch: Fetch, start: int) -> bool:
        """Write the fetched blocks that extend `seq`'s device prefix now into free blocks named with their
        hashes (fetched position i is prefix block `start + i`); release the fetch's host bytes either way.
        True when every fetched position was used."""
        bm = self.block_manager
        hits = bm.find_cached_prefix(seq)
        if len(hits) < start:           # the device lost blocks before the fetched run: it extends nothing
            fetch.release()
            return False
        end = start + len(fetch.tensors)
        hashes = bm.block_hashes(seq, end)
        pinned = list(hits)
        bm.pin(pinned)                  # importing takes free blocks: the hits must not be evicted for them
        try:
            for pos in range(len(hits), end):
                block_id = bm.cached.get(hashes[pos])
                if block_id is not None:                 # the device has it (its prefix was evicted, not it)
                    bm.pin([block_id])
                    pinned.append(block_id)
                    continue
                tensors = fetch.tensors[pos - start]
                if tensors is None or bm.num_free_blocks <= 1:     # evicted meanwhile; or no room (one for the tail)
                    return False
                block_id = bm.import_block(hashes[pos])
                pinned.append(block_id)
                self.runner.write_kv_block(block_id, tensors)
                self.blocks_loaded += 1
            return True
        finally:
            bm.unpin(pinned)
            fetch.release()

    def _drop_fetch(self, seq: Sequence) -> tuple[Fetch, int] | None:
        """Take `seq`'s fetch out of the books (None: it had none)."""
        entry = self._fetches.pop(seq.seq_id, None)
        if entry is not None:
            first_hash = self.block_manager.block_hashes(seq, entry[1] + 1)[entry[1]]
            if self._fetching.get(first_hash) == seq.seq_id:
                del self._fetching[first_hash]
        return entry

    def wait_for_fetch(self, timeout: float) -> None:
        """Block the caller (an engine with nothing else to do) until a fetch finishes, at most `timeout` s."""
        self.fetcher.wait_any(timeout)

    def forget(self, seq: Sequence) -> None:
        """`seq` finished (or was aborted): its fetch, if any, is dropped; its memo goes."""
        entry = self._drop_fetch(seq)
        if entry is not None:
            entry[0].cancel()
            self.fetches_dropped += 1
        self._deferred.pop(seq.seq_id, None)
        self._looked_up.pop(seq.seq_id, None)

    # --- save --------------------------------------------------------------------------------
    def save_finished(self, seq: Sequence) -> None:
        """Queue a finishing sequence's computed full blocks (those the store does not hold yet)."""
        todo = [(h, b) for h, b in self.block_manager.named_blocks(seq) if not self.store.has(self.name(h))]
        self.saved_on_finish += self._save(todo)

    def save_evicted(self, block_id: int, block_hash: bytes) -> None:
        """BlockManager.evict_hook: the block's KV is about to be overwritten; keep it if the store lacks it."""
        if not self.store.has(self.name(block_hash)):
            self.saved_on_evict += self._save([(block_hash, block_id)])

    def _save(self, blocks: list[tuple[bytes, int]]) -> int:
        """Queue host copies of `blocks`; how many the store took."""
        if not blocks:
            return 0
        copies = self.runner.read_kv_blocks([b for _, b in blocks])
        return sum(self.store.save(self.name(block_hash), tensors)
                   for (block_hash, _), tensors in zip(blocks, copies))

    # --- the rest ----------------------------------------------------------------------------
    def metrics(self) -> dict:
        return {**self.store.metrics(), "blocks_loaded": self.blocks_loaded,
                "saved_on_finish": self.saved_on_finish, "saved_on_evict": self.saved_on_evict,
                "load_failures": self.load_failures, "admission_load_s": self.admission_load_s,
                "fetch_s": self.fetcher.fetch_s, "fetches": self.fetches,
                "fetches_in_flight": self.fetcher.num_unfinished, "fetches_deferred": self.fetches_deferred,
                "fetches_dropped": self.fetches_dropped, "fetches_timed_out": self.fetches_timed_out, "fetch_bytes_reserved": self.fetcher.budget.reserved,
                "fetch_bytes_high_water": self.fetcher.budget.high_water,
                "max_fetch_bytes": self.fetcher.budget.max_bytes}

    def flush(self, timeout: float | None = None) -> bool:
        return self.store.flush(timeout)

    def close(self) -> None:
        self.fetcher.close()
        self.store.close()


def attach_kv_store(config: EngineConfig, runner, block_manager: BlockManager, scheduler) -> KVStoreConnector | None:
    """Build the configured KV store and hook it into the scheduler and block manager (None: none configured).
    Raises ValueError for a model whose KV the store cannot hold."""
    if config.kv_store is None:
        return None
    why_not = runner.blocks_not_storable()
    if why_not:
        raise ValueError(f"kv_store is not supported for this model: {why_not}")
    layers = runner.model.attention_layers()
    fingerprint = model_fingerprint(runner.model, layers, config.model.hf_config, config.model.dtype,
                                    config.cache.block_size, config.model.quantization,
                                    batch_invariant=config.model.batch_invariant)
    connector = KVStoreConnector(KVStore.from_config(config.kv_store), runner, block_manager, fingerprint,
                                 config.kv_store.max_fetch_bytes, config.kv_store.fetch_timeout_s)
    block_manager.evict_hook = connector.save_evicted
    scheduler.kv_store = connector
    logger.info("kv store: %s (model fingerprint %s)", config.kv_store.backend, fingerprint.hex())
    return connector
