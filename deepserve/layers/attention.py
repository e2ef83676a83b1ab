"""Paged attention: the backend protocol and its PyTorch reference implementation.

A backend owns two things: how a layer's new keys/values are written into the paged cache (after the
layer's rotary embedding, when the layer hands it over: the GPU backend fuses the two), and how
queries attend over a sequence's cached keys. `build_metadata` runs once per step (index tensors
shared by all layers); `forward` runs per layer. The GPU path swaps in Triton kernels with the same
signatures; this reference (its tensor math in kernels/reference/attention.py) is what the CPU runs and
what those kernels are tested against.

KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = keys, 1 = values).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from deepserve.kernels import cpu as cpu_kernels
from deepserve.kernels.reference.attention import (causal_prefill_attention, gather_blocks,  # noqa: F401
                                                  masked_decode_attention, window_start, write_kv)
from deepserve.layers.forward_batch import ForwardBatch
from deepserve.layers.linear import fused_qkv_rotary_rows, fused_qkv_rotary_write
from deepserve.layers.norm import RMSNorm
from deepserve.layers.rotary import RotaryEmbedding


class AttentionBackend(Protocol):
    def build_metadata(self, batch: ForwardBatch) -> object: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                batch: ForwardBatch, scale: float, rotary: RotaryEmbedding | None = None,
                qk_norm: tuple[RMSNorm, RMSNorm] | None = None, prefetch: torch.Tensor | None = None,
                window: int = 0) -> torch.Tensor:
        """q [T, H, D], k, v [T, Hkv, D] -> [T, H, D]. `window` > 0: a sliding window, each query attends to the
        `window` keys ending at its own position (HF's rule: key j visible to query i when i - window < j <= i);
        0: to every key up to its position. With `rotary`, q and k are first rotated at
        batch.positions (`rotary(batch.positions, q, k)`), so that a backend may fuse that with its cache write;
        with `qk_norm` (Qwen3's per-head q_norm, k_norm), q and k are normalised before that, fused there too.
        `prefetch`: the weight read right after the attention (o_proj's), which a backend may ask into the GPU's
        L2 while it attends (kernels/l2_prefetch.py); a hint that changes no result."""
        ...


@dataclass
class _PrefillSegment:
    row_start: int
    num_rows: int
    first_position: int       # position of the segment's first query token
    seq_len: int              # keys visible to the segment's last query
    blocks: torch.Tensor      # [ceil(seq_len / block_size)] the sequence's blocks, in order


@dataclass
class TorchAttentionMetadata:
    decode_rows: torch.Tensor | None      # [Bd] rows of 1-token sequences
    decode_blocks: torch.Tensor | None    # [Bd, max_blocks] their block tables (padded with block 0)
    decode_mask: torch.Tensor | None      # [Bd, max_blocks * block_size] True where a slot is a real key
    decode_lens: torch.Tensor | None      # [Bd] keys per decode row (the sliding windows' masks start from them)
    prefills: list[_PrefillSegment]
    decode_plan: cpu_kernels.DecodePlan | None = None   # the decode rows for the CPU kernel (None: no kernel)
    # Batch-invariant mode: each decode row's own key count; the PyTorch fallback then attends row by row over
    # exactly those keys (no padding to the batch's longest sequence, which would change the sums' shapes).
    row_seq_lens: list[int] | None = None
    window_masks: dict[int, torch.Tensor] = field(default_factory=dict)    # decode_mask within each sliding window

    def decode_mask_within(self, window: int) -> torch.Tensor:
        """decode_mask narrowed to each row's last `window` keys (0: decode_mask), built once per step and window."""
        if window <= 0:
            return self.decode_mask
        if window not in self.window_masks:
            positions = torch.arange(self.decode_mask.shape[1], device=self.decode_mask.device)
            self.window_masks[window] = self.decode_mask & (positions[None, :] >= self.decode_lens[:, None] - window)
        return self.window_masks[window]


class TorchPagedAttention:
    """Reference backend: decodes batched into one masked matmul, prefills one sequence at a time.

    Keys are gathered a whole block at a time (a block is one contiguous run of memory), which is
    several times faster on a CPU than gathering token slots one by one.

    On the CPU, fp32 decode rows go to a C kernel instead (deepserve/kernels/cpu) that reads each cached
    key/value once, in place, without the gather; the matmul path stays as its fallback and reference.

    `rows_as_decodes` (batch-invariant mode): every query row, prefill and prompt-chunk rows included, is run as a
    decode row over its own first position + 1 keys (the cache holds the step's keys before any row attends).
    The decode kernel folds a row's keys block by block in one order fixed by the row's own keys, so a row's
    output is the same alone, in any batch, at any chunk boundary and over a prefix-cache hit.
    """

    def __init__(self, rows_as_decodes: bool = False) -> None:
        self.rows_as_decodes = rows_as_decodes

    def build_metadata(self, batch: ForwardBatch) -> TorchAttentionMetadata:
        if batch.num_tokens == batch.num_seqs and not self.rows_as_decodes:
            return self._decode_step_metadata(batch)
        bs = batch.block_size
        device = batch.input_ids.device
        drafts = batch.draft_lens_cpu or [0] * len(batch.query_lens_cpu)
        # A decode with drafts is a run of decode rows of consecutive lengths: the decode path takes it row by row
        # (batched with every other decode, and with the numerics of a plain decode step for its first row).
        as_decode = [self.rows_as_decodes or q == 1 or d > 0 for q, d in zip(batch.query_lens_cpu, drafts)]
        decode_b = [b for b, d in enumerate(as_decode) if d]
        prefill_b = [b for b, d in enumerate(as_decode) if not d]
        starts = batch.query_start_loc.tolist()
        meta = TorchAttentionMetadata(None, None, None, None, [])
        if decode_b:
            if any(drafts) or self.rows_as_decodes:
                rows = [(starts[b] + j, b, batch.seq_lens_cpu[b] - batch.query_lens_cpu[b] + 1 + j)
                        for b in decode_b for j in range(batch.query_lens_cpu[b])]
                idx = torch.tensor([b for _, b, _ in rows], device=device)
                row_starts = [r for r, _, _ in rows]
                seq_lens = torch.tensor([n for _, _, n in rows], device=device)
            else:
                idx = torch.tensor(decode_b, device=device)
                row_starts = [starts[b] for b in decode_b]
                seq_lens = batch.seq_lens[idx]
            num_blocks = -(-max(batch.seq_lens_cpu[b] for b in decode_b) // bs)
            meta.decode_rows = torch.tensor(row_starts, device=device)
            meta.decode_blocks = batch.block_tables[idx, :num_blocks].contiguous()
            positions = torch.arange(num_blocks * bs, device=device)
            meta.decode_mask = positions[None, :] < seq_lens[:, None]
            meta.decode_lens = seq_lens
            if device.type == "cpu" and cpu_kernels.library() is not None:
                meta.decode_plan = cpu_kernels.DecodePlan(meta.decode_rows, meta.decode_blocks, seq_lens)
            if self.rows_as_decodes:
                meta.row_seq_lens = seq_lens.tolist()
        for b in prefill_b:
            n, seq_len = batch.query_lens_cpu[b], batch.seq_lens_cpu[b]
            blocks = batch.block_tables[b, : -(-seq_len // bs)]
            meta.prefills.append(_PrefillSegment(starts[b], n, seq_len - n, seq_len, blocks))
        return meta

    def _decode_step_metadata(self, batch: ForwardBatch) -> TorchAttentionMetadata:
        """`build_metadata` of a step of one row per sequence (every one a plain decode: row b is sequence b), from
        views of the batch's tensors: no per-sequence index lists to build and copy at every decode step."""
        bs, device = batch.block_size, batch.input_ids.device
        num_blocks = -(-max(batch.seq_lens_cpu) // bs)
        meta = TorchAttentionMetadata(None, None, None, None, [])
        meta.decode_rows = batch.query_start_loc[:-1]           # = 0, 1, ..., B - 1
        meta.decode_blocks = batch.block_tables[:, :num_blocks].contiguous()
        positions = torch.arange(num_blocks * bs, device=device)
        meta.decode_mask = positions[None, :] < batch.seq_lens[:, None]
        meta.decode_lens = batch.seq_lens
        if device.type == "cpu" and cpu_kernels.library() is not None:
            meta.decode_plan = cpu_kernels.DecodePlan(meta.decode_rows, meta.decode_blocks, batch.seq_lens)
        return meta

    def forward(self, q, k, v, kv_cache, batch, scale, rotary=None, qk_norm=None, prefetch=None, window=0):
        meta: TorchAttentionMetadata = batch.attn_metadata
        if qk_norm is not None:
            q, k = qk_norm[0](q), qk_norm[1](k)
        if rotary is not None:
            q, k = rotary(batch.positions, q, k)
        write_kv(kv_cache, k, v, batch.slot_mapping)
        k_cache, v_cache = kv_cache[0], kv_cache[1]       # [num_blocks, block_size, Hkv, D]
        out = torch.empty_like(q)
        if meta.decode_rows is not None:
            plan = meta.decode_plan
            if plan is not None and plan.run(q, kv_cache, out, scale, window):
                pass
            elif meta.row_seq_lens is not None:
                _decode_rows_one_by_one(q, k_cache, v_cache, meta, out, scale, window)
            else:
                keys = gather_blocks(k_cache, meta.decode_blocks).flatten(1, 2)    # [Bd, max_blocks * bs, Hkv, D]
                values = gather_blocks(v_cache, meta.decode_blocks).flatten(1, 2)
                out[meta.decode_rows] = masked_decode_attention(q[meta.decode_rows], keys, values,
                                                                meta.decode_mask_within(window), scale)
        for seg in meta.prefills:
            rows = slice(seg.row_start, seg.row_start + seg.num_rows)
            # Keys from the first one the segment's first query sees (through a window, not always key 0).
            first_key = window_start(seg.first_position + 1, window)
            keys = _segment_keys(k_cache, seg, first_key).to(q.dtype)
            values = _segment_keys(v_cache, seg, first_key).to(q.dtype)
            out[rows] = causal_prefill_attention(q[rows], keys, values, seg.first_position - first_key, scale, window)
        return out


def _segment_keys(cache: torch.Tensor, seg: _PrefillSegment, first_key: int) -> torch.Tensor:
    """A prefill segment's keys (or values) `first_key` .. seq_len - 1, gathered from the block holding first_key on
    (the whole blocks before it are not read)."""
    first_block = first_key // cache.shape[1]
    skipped = first_block * cache.shape[1]          # keys in the blocks not read
    return gather_blocks(cache, seg.blocks[first_block:]).flatten(0, 1)[first_key - skipped: seg.seq_len - skipped]


def _decode_rows_one_by_one(q, k_cache, v_cache, meta: TorchAttentionMetadata, out, scale: float,
                            window: int = 0) -> None:
    """Each decode row over exactly its own keys (the last `window` of them, window > 0: the batch-invariant fallback
    without the C kernel): every tensor a row's result is computed from has a shape fixed by that row alone."""
    block_size = k_cache.shape[1]
    for i, (row, seq_len) in enumerate(zip(meta.decode_rows.tolist(), meta.row_seq_lens)):
        blocks = meta.decode_blocks[i, : -(-seq_len // block_size)]
        first = window_start(seq_len, window)
        keys = gather_blocks(k_cache, blocks).flatten(0, 1)[None, first:seq_len]
        values = gather_blocks(v_cache, blocks).flatten(0, 1)[None, first:seq_len]
        every_key = torch.ones(1, seq_len - first, dtype=torch.bool, device=q.device)
        out[row:row + 1] = masked_decode_attention(q[row:row + 1], keys, values, every_key, scale)


class Attention(nn.Module):
    """One layer's attention over the paged cache; the cache is bound by the model runner."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int = 0) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        # > 0: a query attends to the sliding_window keys ending at its position (Mistral v0.1, Qwen's windowed
        # layers). Every key stays cached: the window bounds what is read, not what is kept.
        self.sliding_window = sliding_window
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionBackend = TorchPagedAttention()

    # The model runner sizes and allocates every layer's cache through these two methods, so a layer
    # with another per-token state (MLA's compressed latent, a sliding window) only overrides them.
    kv_block_dim = 1   # the block index's dimension in kv_cache_shape (used for copy-on-write copies)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_kv_heads * self.head_dim * torch.empty(0, dtype=dtype).element_size()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
                rotary: RotaryEmbedding | None = None, qk_norm: tuple[RMSNorm, RMSNorm] | None = None,
                prefetch: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q over the cached keys after k, v are written; `rotary` (if given) rotates q and k first,
        after `qk_norm` (if given) normalised them per head; `prefetch`: the weight read next (a hint,
        AttentionBackend.forward)."""
        assert self.kv_cache is not None, "the model runner binds a KV cache before the first forward"
        return self.backend.forward(q, k, v, self.kv_cache, batch, self.scale, rotary=rotary, qk_norm=qk_norm,
                                    prefetch=prefetch, window=self.sliding_window)

    def forward_from_hidden(self, x: torch.Tensor, qkv_proj: nn.Module, batch: ForwardBatch,
                            rotary: RotaryEmbedding, norm: nn.Module | None = None,
                            prefetch: torch.Tensor | None = None) -> torch.Tensor | None:
        """`forward` of qkv_proj(x) (of qkv_proj(norm(x)) given an RMSNorm `norm`) split into q, k, v, when one
        launch can normalise, project, rotate and write the cache (batch-1 decode on the GPU; a backend that can
        attend to an already written cache, a plain NeoX rotary embedding); None otherwise, and the caller takes
        the usual path. `prefetch` as in `forward` (the fused launches do not take it)."""
        attend_cached = getattr(self.backend, "attend_cached", None)
        if attend_cached is None or not fused_qkv_rotary_rows(x) or type(rotary) is not RotaryEmbedding \
                or not batch.is_decode_only:
            return None
        q = fused_qkv_rotary_write(x, qkv_proj, self.kv_cache, batch, rotary, self.num_heads, self.num_kv_heads,
                                   norm)
        return None if q is None else attend_cached(q, self.kv_cache, batch, self.scale, prefetch=prefetch,
                                                    window=self.sliding_window)
