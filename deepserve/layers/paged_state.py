"""Paged per-layer state for DeepSeek-V4-family layers (deepinfer.md §2.11), in two pools of the engine's blocks.

A V4.1 layer keeps several kinds of state, each its own `PagedState` (the model runner sizes, allocates and
copies each like any layer cache; `kv_block_dim` 0):

    kind              where                               per block of `bs` token positions   pool
    SWA keys          every layer                          bs tokens x D (keys = values)       window
    compressor state  KV-source compressed layers          bs tokens x state_width (fp32)      window
    token ids         Engram models, once                  bs tokens x 1 (int64)               window
    compressed KV     KV-source compressed layers          bs/ratio entries x D                main
    index keys        index-K-source layers                bs/ratio entries x Di               main

Per-position states (`ratio` 0) are read only a few positions back: the sliding window (W - 1), a compressor's
span, the n-gram history. They live in the window pool (engine/block_manager.py), whose blocks a sequence gives
back once its next row can no longer read them: DeepInfer's per-sequence SWA ring, at block granularity. The
compressed states grow with the context and live in the main pool, on the block table. `RowSlots.token_slots` reads
the window tables, `entry_slots` the block tables; `ForwardBatch.window_slots` is where rows write their window
states. A prefix-cache hit (block aligned, hence aligned to every ratio dividing bs) brings back both: the main
blocks and the window blocks before the hit point (a hit is taken only where those are cached), so chunked prefill
(a half-done ratio-2 entry waits in the compressor state), preemption (recompute), copy-on-write and prefix hits are
exact.

Layers that share (§2.2) hold a reference to their source's state, not a copy (aliasing), so the memory
accounting counts each state once.

`SequenceLayout` (per sequence: its rows, positions, blocks) and `RowSlots` (per row: the slot of any position or
compressed entry of its sequence, for all rows at once) are how these are read and written.

Slot -1, the scratch slot: a write that must land nowhere (a padding row of a decode replayed from a CUDA graph, an
entry that a decode row does not complete) goes to slot -1, which indexing wraps to the last slot of the last block.
The model runner allocates one scratch block past the block manager's in each pool for models with paged states
(`writes_scratch_slot`), so that slot belongs to no sequence. Writing there instead of selecting the rows that do
write keeps a decode step's shapes fixed (no host sync, capturable in a CUDA graph).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from deepserve.layers.forward_batch import ForwardBatch


class PagedState(nn.Module):
    """`width` values per slot; a slot is a token position (`ratio` 0) or a compressed entry (`ratio` > 0, one per
    `ratio` positions; at least one per block). `dtype` None: the cache dtype the runner chooses."""

    kv_block_dim = 0
    writes_scratch_slot = True          # the runner allocates the scratch block (module doc)

    def __init__(self, name: str, width: int, ratio: int = 0, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.name, self.width, self.ratio, self.cache_dtype = name, width, ratio, dtype
        self.kv_cache: torch.Tensor | None = None

    @property
    def pool(self) -> str:
        """"window": a per-position state, read a bounded number of positions back; "main": compressed entries."""
        return "window" if self.ratio == 0 else "main"

    def slots_per_block(self, block_size: int) -> int:
        return block_size if self.ratio == 0 else max(1, block_size // self.ratio)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, self.slots_per_block(block_size), self.width)

    def kv_bytes_per_block(self, dtype: torch.dtype, block_size: int) -> int:
        dtype = self.cache_dtype or dtype
        return self.slots_per_block(block_size) * self.width * torch.empty(0, dtype=dtype).element_size()

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        raise TypeError("a PagedState's size depends on the block size: use kv_bytes_per_block")

    def flat(self) -> torch.Tensor:
        """[num_blocks * slots_per_block, width]: slot s is row s."""
        assert self.kv_cache is not None, "the model runner binds the caches before the first forward"
        return self.kv_cache.view(-1, self.width)

    def write(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        """values at slots; slot -1 is the scratch slot (module doc)."""
        self.flat()[slots] = values.to(self.kv_cache.dtype).view(-1, self.width)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        return self.flat()[slots]


@dataclass
class SequenceLayout:
    """One sequence of the step: rows [row_start, row_start + num_rows) at positions [first_pos, seq_len)."""
    row_start: int
    num_rows: int
    first_pos: int
    seq_len: int
    blocks: torch.Tensor          # [ceil(seq_len / bs)] its block ids
    block_size: int
    data_len: int                 # the sequence's whole length (>= seq_len for a prompt chunk)

    @property
    def rows(self) -> slice:
        return slice(self.row_start, self.row_start + self.num_rows)

    def entry_slots(self, ratio: int, count: int) -> torch.Tensor:
        """Slots of compressed entries 0 .. count - 1 (entry j sits in the block of its last token)."""
        per_block = max(1, self.block_size // ratio)
        j = torch.arange(count, device=self.blocks.device)
        block = self.blocks[(j * ratio + ratio - 1) // self.block_size]
        return block * per_block + j % per_block


@dataclass
class RowSlots:
    """Slot arithmetic for every row at once (no loop over sequences): row i belongs to sequence row_seq[i], whose
    block table is block_tables[row_seq[i]] and window table window_tables[row_seq[i]]."""
    block_tables: torch.Tensor     # [B, max_blocks] (main pool: compressed entries)
    row_seq: torch.Tensor          # [rows]
    block_size: int
    window_tables: torch.Tensor    # [B, max_blocks] (window pool: per-position states)

    @staticmethod
    def of(batch: ForwardBatch) -> "RowSlots":
        device = batch.block_tables.device
        if batch.is_decode_only:            # row b is sequence b: no host list to copy (a CUDA graph captures this)
            return RowSlots(batch.block_tables, torch.arange(batch.num_seqs, device=device), batch.block_size,
                            batch.window_tables)
        seq_of_row = [b for b, q in enumerate(batch.query_lens_cpu) for _ in range(q)]
        return RowSlots(batch.block_tables, torch.tensor(seq_of_row, dtype=torch.long, device=device),
                        batch.block_size, batch.window_tables)

    def select(self, rows: torch.Tensor) -> "RowSlots":
        return RowSlots(self.block_tables, self.row_seq[rows], self.block_size, self.window_tables)

    def _block(self, tables: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Block ids at table positions index [rows, K] (clamped into the table: callers mask what is invalid)."""
        index = index.clamp(0, tables.shape[1] - 1)
        return tables[self.row_seq[:, None].expand_as(index), index]

    def token_slots(self, positions: torch.Tensor) -> torch.Tensor:
        """[rows, K] token positions of each row's sequence -> their window-state slots (negative positions, and
        positions of released window blocks: garbage, mask them)."""
        bs = self.block_size
        p = positions.clamp(min=0)
        return self._block(self.window_tables, p // bs) * bs + p % bs

    def entry_slots(self, j: torch.Tensor, ratio: int) -> torch.Tensor:
        """[rows, K] compressed entry indices of each row's sequence -> their slots (as SequenceLayout.entry_slots)."""
        per_block = max(1, self.block_size // ratio)
        return self._block(self.block_tables, (j * ratio + ratio - 1) // self.block_size) * per_block + j % per_block


def sequence_layouts(batch: ForwardBatch) -> list[SequenceLayout]:
    """The step's sequences in batch order (built once per forward, shared by every layer)."""
    bs = batch.block_size
    layouts, start = [], 0              # row starts from the host's lengths (query_start_loc is on the device)
    data_lens = batch.data_lens_cpu or batch.seq_lens_cpu
    for b, (q, n) in enumerate(zip(batch.query_lens_cpu, batch.seq_lens_cpu)):
        blocks = batch.block_tables[b, : -(-n // bs)]
        layouts.append(SequenceLayout(start, q, n - q, n, blocks, bs, data_lens[b]))
        start += q
    return layouts


def keep_rows(layouts: list[SequenceLayout], kept_from: list[int]) -> tuple[list[SequenceLayout], list[int]]:
    """Each sequence restricted to its rows at positions >= kept_from[b] (a suffix of its rows): the new layouts,
    numbered from row 0, and the kept rows' indices in the old numbering."""
    new, rows, start = [], [], 0
    for seq, lo in zip(layouts, kept_from):
        n = seq.seq_len - lo
        rows.extend(range(seq.row_start + lo - seq.first_pos, seq.row_start + seq.num_rows))
        new.append(dataclasses.replace(seq, row_start=start, num_rows=n, first_pos=lo))
        start += n
    return new, rows
