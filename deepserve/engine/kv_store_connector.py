"""The engine's side of the KV store: which blocks are saved and when, which are loaded and where to.

Save (write-behind): a finished sequence's computed full blocks (`Scheduler.finish`, before they are freed) and a
named block the device cache evicts (`BlockManager.evict_hook`, before it is overwritten: this catches preempted
and aborted sequences' blocks). The engine thread only gathers a host copy of the blocks (a memcpy on the CPU, one
device-to-host copy per layer on a GPU); encoding, checksums and I/O run on the store's writer thread. Blocks the
store already holds (as far as this process knows) are not copied again.

Load (at admission, synchronous): before the scheduler's prefix lookup, the blocks after the device cache's hits
that the store holds are read, verified, and written into free blocks that the block manager names with their
hashes (`import_block`); the scheduler's `find_cached_prefix` then finds them like any cached block, so they
count as computed, in `num_cached_tokens` too. A load that fails (missing, corrupt, a store gone away) ends the
run there: the rest of the prompt is computed. At least one prompt token is always left to compute (the logits
come from it), as for device hits.

Block-manager invariants hold throughout: loaded blocks are pinned while written and then released to the free
queue named (ref count 0, cached), exactly the state of a cached block nobody holds.
"""

from __future__ import annotations

import logging
import time

from deepserve.config import EngineConfig
from deepserve.engine.block_manager import BlockManager
from deepserve.kvstore.keys import entry_name, layer_layout, model_fingerprint
from deepserve.kvstore.store import KVStore
from deepserve.sequence import Sequence

logger = logging.getLogger(__name__)


class KVStoreConnector:
    def __init__(self, store: KVStore, runner, block_manager: BlockManager, fingerprint: bytes) -> None:
        self.store = store
        self.runner = runner
        self.block_manager = block_manager
        self.fingerprint = fingerprint
        self.layouts = [layer_layout(layer) for layer in runner.model.attention_layers()]
        self.blocks_loaded = 0
        self.saved_on_finish = 0       # blocks queued when their sequence finished
        self.saved_on_evict = 0        # blocks queued when the device cache evicted them (preempted sequences)
        self.load_failures = 0          # blocks the store said it held but could not give (then recomputed)
        self.admission_load_s = 0.0     # engine-thread time spent loading at admission
        # seq_id -> (device hits, preemptions) when the store last lacked its next block: a waiting sequence
        # re-examined every step does not ask the store again until that changes
        self._looked_up: dict[int, tuple[int, int]] = {}

    def name(self, block_hash: bytes) -> str:
        return entry_name(self.fingerprint, block_hash)

    # --- load --------------------------------------------------------------------------------
    def load_prefix(self, seq: Sequence) -> None:
        """Load the store's blocks that extend `seq`'s device-cache prefix into the device cache."""
        if seq.params.prompt_logprobs is not None:
            return                      # prompt logprobs need the whole prompt computed
        bm = self.block_manager
        hits = bm.find_cached_prefix(seq)
        max_blocks = (seq.num_tokens - 1) // bm.block_size     # the last token is always computed
        memo = (len(hits), seq.num_preemptions)
        if len(hits) >= max_blocks or self._looked_up.get(seq.seq_id) == memo:
            return
        # Room: free blocks, less the hits that leave the free queue at admission and one block for the tail.
        room = bm.num_free_blocks - sum(1 for b in hits if bm.blocks[b].ref_count == 0) - 1
        hashes = bm.block_hashes(seq, max_blocks)[len(hits):][:max(room, 0)]
        t0 = time.perf_counter()
        names = [self.name(h) for h in hashes]
        held = self.store.lookup(names)
        if held:
            self._load_run(hits, hashes, names[:held])
        elif names:
            self._looked_up[seq.seq_id] = memo     # the store lacks the next block: no new lookup until hits change
        self.admission_load_s += time.perf_counter() - t0

    def _load_run(self, hits: list[int], hashes: list[bytes], names: list[str]) -> int:
        """Write the leading blocks of `names` the store gives intact into the device cache; how many it did."""
        bm = self.block_manager
        pinned = list(hits)
        bm.pin(pinned)                  # loading takes free blocks: the hits must not be evicted for them
        try:
            for block_hash, name in zip(hashes, names):
                if block_hash in bm.cached:          # the device has it (its prefix was evicted, not it)
                    block_id = bm.cached[block_hash]
                    bm.pin([block_id])
                    pinned.append(block_id)
                    continue
                tensors = self.store.load(name)
                if tensors is None or not self._fits_layout(tensors):
                    self.load_failures += 1
                    break
                block_id = bm.import_block(block_hash)
                pinned.append(block_id)
                self.runner.write_kv_block(block_id, tensors)
                self.blocks_loaded += 1
        finally:
            bm.unpin(pinned)
        return len(pinned) - len(hits)

    def _fits_layout(self, tensors) -> bool:
        return len(tensors) == len(self.layouts) and all(
            tuple(t.shape) == shape and t.dtype == dtype for t, (shape, dtype) in zip(tensors, self.layouts))

    # --- save --------------------------------------------------------------------------------
    def save_finished(self, seq: Sequence) -> None:
        """Queue a finishing sequence's computed full blocks (those the store does not hold yet)."""
        self._looked_up.pop(seq.seq_id, None)
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
                "load_failures": self.load_failures, "admission_load_s": self.admission_load_s}

    def flush(self, timeout: float | None = None) -> bool:
        return self.store.flush(timeout)

    def close(self) -> None:
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
    connector = KVStoreConnector(KVStore.from_config(config.kv_store), runner, block_manager, fingerprint)
    block_manager.evict_hook = connector.save_evicted
    scheduler.kv_store = connector
    logger.info("kv store: %s (model fingerprint %s)", config.kv_store.backend, fingerprint.hex())
    return connector
