"""The KV cache's layout: which of the model's caches live in which pool, their bytes per block, how a byte budget
splits between the pools, the allocation, copy-on-write copies, and blocks copied out to the host and back in (the
KV store's, engine/kv_store_connector.py).

Every layer cache (a standard attention layer's KV, MLA's latent cache, a DeepSeek-V4-family `PagedState`) lives in
the main pool, on the block table, except per-position states that are read only a bounded way back (DeepSeek-V4 /
V4.1's sliding-window keys, compressor states, Engram token ids, DSpark main keys: `PagedState.pool == "window"`):
they live in the window pool, whose blocks a sequence gives back once its next row can no longer read them
(engine/block_manager.py). Both pools have the same block size; each cache gets one scratch block past its pool's
blocks when the model writes slot -1 or runs placeholder steps (layers/paged_state.py).
"""

from __future__ import annotations

import torch

from deepserve.config import EngineConfig
from deepserve.kernels.reference.attention import as_bytes


class KVCacheLayout:
    def __init__(self, model, config: EngineConfig, dtype: torch.dtype) -> None:
        self.model, self.config, self.dtype = model, config, dtype
        self.block_size = config.cache.block_size
        self.window_ids = {id(layer) for layer in model.attention_layers()
                           if getattr(layer, "pool", "main") == "window"}

    # --- sizes --------------------------------------------------------------------------------
    def window_states(self) -> list:
        return [layer for layer in self.model.attention_layers() if id(layer) in self.window_ids]

    def cache_dtype(self, layer) -> torch.dtype:
        """A layer may keep a state in a dtype of its own (fp32 compressor state, int64 token ids)."""
        return getattr(layer, "cache_dtype", None) or self.dtype

    def _block_bytes(self, layer) -> int:
        if hasattr(layer, "kv_bytes_per_block"):        # slots not one per token (e.g. a compressed KV state)
            return layer.kv_bytes_per_block(self.dtype, self.block_size)
        return layer.kv_bytes_per_token(self.dtype) * self.block_size

    def main_bytes_per_block(self) -> int:
        return sum(self._block_bytes(layer) for layer in self.model.attention_layers()
                   if id(layer) not in self.window_ids)

    def window_bytes_per_block(self) -> int:
        """0: the model has no window pool."""
        return sum(self._block_bytes(layer) for layer in self.window_states())

    def window_blocks_range(self) -> tuple[int, int]:
        """(least, wanted) window-pool blocks. Least: one sequence's largest step, a chunk of max_num_batched_tokens
        (+ drafts) and the `reach` positions behind it, + 2 for block boundaries (so any one sequence always fits).
        Wanted: every one of max_num_seqs sequences holding its window while decoding, plus the largest chunk, and as
        many again for cached window blocks: a prefix hit needs the window blocks before its hit point."""
        sched, bs = self.config.scheduler, self.block_size
        reach = self.model.window_reach()
        spec = self.config.speculative
        drafts = spec.num_speculative_tokens if spec is not None else 0
        least = -(-(sched.max_num_batched_tokens + drafts + reach) // bs) + 2
        per_seq = -(-(reach + drafts) // bs) + 2
        return least, 2 * (sched.max_num_seqs * per_seq + -(-sched.max_num_batched_tokens // bs))

    def wanted_bytes(self) -> int:
        """Every sequence at full length in the main pool, and what the window pool wants."""
        sched = self.config.scheduler
        want = int(sched.max_num_seqs * sched.max_model_len * self.main_bytes_per_block() / self.block_size)
        if self.window_ids:
            want += self.window_blocks_range()[1] * self.window_bytes_per_block()
        return want

    def least_window_bytes(self) -> int:
        return self.window_blocks_range()[0] * self.window_bytes_per_block() if self.window_ids else 0

    def split(self, budget: int) -> tuple[int, int]:
        """(main blocks, window blocks) of a KV budget. The window pool gets what it wants if the main pool keeps the
        blocks of one max_model_len sequence, else what is left beside those, but never less than its least (a
        budget below that is refused: a sequence could otherwise never be scheduled)."""
        per_block, window_per_block = self.main_bytes_per_block(), self.window_bytes_per_block()
        if not window_per_block:
            return max(budget // per_block, 1), 0
        least, wanted = self.window_blocks_range()
        sched = self.config.scheduler
        main_least = -(-sched.max_model_len // self.block_size)
        if not per_block:       # window layers only: the block table names no memory, only positions
            main_least = sched.max_num_seqs * main_least
        window = min(wanted, (budget - main_least * per_block) // window_per_block)
        if window < least:
            need = least * window_per_block + main_least * per_block
            raise ValueError(f"the KV cache budget ({budget / 2**20:.1f} MiB) is below what one sequence needs "
                             f"({need / 2**20:.1f} MiB: {least} window blocks for a max_num_batched_tokens="
                             f"{sched.max_num_batched_tokens} step and its sliding window, and {main_least} blocks of "
                             f"a max_model_len={sched.max_model_len} sequence): raise kv_cache_memory_bytes or "
                             "gpu_memory_utilization, or lower max_num_batched_tokens or max_model_len")
        if not per_block:
            return main_least, window
        return max((budget - window * window_per_block) // per_block, 1), window

    # --- memory -------------------------------------------------------------------------------
    def allocate(self, num_blocks: int, num_window_blocks: int, scratch: bool,
                 device: torch.device) -> list[torch.Tensor]:
        """Zeroed caches, bound to their layers (+ one scratch block per cache when `scratch`)."""
        caches = []
        for layer in self.model.attention_layers():
            blocks = (num_window_blocks if id(layer) in self.window_ids else num_blocks) + (1 if scratch else 0)
            layer.kv_cache = torch.zeros(layer.kv_cache_shape(blocks, self.block_size), dtype=self.cache_dtype(layer),
                                         device=device)
            caches.append(layer.kv_cache)
        return caches

    def copy_blocks(self, copies: list[tuple[int, int]], window_copies: list[tuple[int, int]],
                    device: torch.device) -> None:
        """Copy-on-write copies (src, dst) of the main pool's blocks, and of the window pool's."""
        for pairs, in_window in ((copies, False), (window_copies, True)):
            if not pairs:
                continue
            src = torch.tensor([s for s, _ in pairs], device=device)
            dst = torch.tensor([d for _, d in pairs], device=device)
            for layer in self.model.attention_layers():
                if (id(layer) in self.window_ids) == in_window:
                    dim, cache = layer.kv_block_dim, as_bytes(layer.kv_cache)
                    cache.index_copy_(dim, dst, cache.index_select(dim, src))

    # --- blocks in and out (the KV store) ---------------------------------------------------------
    def blocks_not_storable(self) -> str | None:
        """Why this model's KV cannot go to a KV store (None: it can). A stored block is each layer's cache at one
        block index; a layer with other paged state (sizes per block, not per token: DeepSeek-V4.1's compressed
        and indexer states) is not covered by that."""
        odd = [type(layer).__name__ for layer in self.model.attention_layers() if hasattr(layer, "kv_bytes_per_block")]
        if odd:
            return f"its layers keep paged states besides per-token KV ({', '.join(sorted(set(odd)))})"
        return None

    def read_blocks(self, block_ids: list[int], device: torch.device) -> list[list[torch.Tensor]]:
        """Host copies of the blocks' caches: for each block, one tensor per layer (the block index taken out).
        One gather per layer; the copies are the caller's (the blocks may be overwritten right after)."""
        index = torch.tensor(block_ids, device=device)
        layers = self.model.attention_layers()
        per_layer = []
        for layer in layers:
            gathered = as_bytes(layer.kv_cache).index_select(layer.kv_block_dim, index).view(layer.kv_cache.dtype)
            per_layer.append(gathered.cpu() if gathered.device.type != "cpu" else gathered)
        return [[t.select(layer.kv_block_dim, i) for t, layer in zip(per_layer, layers)] for i in range(len(block_ids))]

    def write_block(self, block_id: int, tensors: list[torch.Tensor]) -> None:
        """Fill one block of every layer's cache (the inverse of read_blocks for one block)."""
        for layer, t in zip(self.model.attention_layers(), tensors, strict=True):
            as_bytes(layer.kv_cache).select(layer.kv_block_dim, block_id).copy_(as_bytes(t), non_blocking=True)
