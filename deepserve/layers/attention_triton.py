"""TritonPagedAttention: the AttentionBackend of the GPU path (deepserve/layers/attention.py defines the protocol
and the reference, TorchPagedAttention, which this must match).

Per step, `build_metadata` splits the batch into decode rows (one query token) and prefill rows (several: whole
prompts, chunks, prompts over a cached prefix) and builds the small index tensors every layer shares. Per layer,
`forward` writes the new keys/values into the paged cache (given the layer's rotary embedding, one kernel rotates q
and k and writes the cache), then runs the decode kernel (GQA, split-K when contexts are long and the batch is
small) on the decode rows and the prefill kernel on the prefill rows.
"""

from dataclasses import dataclass
from typing import Optional

import torch

from deepserve.kernels.paged_attention import decode_attention, rotary_write_kv, write_kv
from deepserve.kernels.paged_prefill import PREFILL_BLOCK_M, prefill_attention, prefill_tiles


@dataclass
class TritonAttentionMetadata:
    decode_rows: Optional[torch.Tensor]   # [Bd] int64 rows of q that are decodes (None: no decodes)
    decode_seqs: Optional[torch.Tensor]   # [Bd] int64 their sequence index in the batch
    decode_max_len: int                   # longest decode context (host int: sizes the split)
    tile_seq: Optional[torch.Tensor]      # [num_tiles] int32 prefill tiles: sequence index
    tile_m0: Optional[torch.Tensor]       # [num_tiles] int32 first query row of the tile within its sequence
    num_decodes: int
    num_prefill_tiles: int
    # Rows run as decodes of their own length (see `rows_as_decodes`): per-row tables and lengths (None: per sequence)
    row_block_tables: Optional[torch.Tensor] = None
    row_seq_lens: Optional[torch.Tensor] = None


class TritonPagedAttention:
    """GPU backend: Triton kernels with the reference backend's metadata needs (ForwardBatch fields only)."""

    def __init__(self, num_splits: Optional[int] = None, rows_as_decodes: bool = False) -> None:
        """`rows_as_decodes` (batch-invariant mode): every query row runs through the decode kernel as a sequence of
        its own length, never the prefill kernel, and without split-K, so a row's keys are reduced in one order
        whatever the batch, the chunking or the cache hits (deepinfer.md section 9). Rows of a decode verifying
        drafts always run so (speculative decoding: they are decodes one position apart)."""
        self.rows_as_decodes = rows_as_decodes
        self.num_splits = 1 if rows_as_decodes else num_splits   # None: heuristic (tests may force a count)

    def build_metadata(self, batch) -> TritonAttentionMetadata:
        drafts = batch.draft_lens_cpu
        if self.rows_as_decodes or (drafts and any(drafts)):
            return self._row_decode_metadata(batch)
        device = batch.input_ids.device
        q_lens = batch.query_lens_cpu
        decode_b = [b for b, n in enumerate(q_lens) if n == 1]
        prefill_b = [b for b, n in enumerate(q_lens) if n > 1]
        rows, seqs = None, None
        max_len = 0
        if decode_b:
            starts, acc = [], 0
            for n in q_lens:
                starts.append(acc)
                acc += n
            rows = torch.tensor([starts[b] for b in decode_b], dtype=torch.int64).to(device, non_blocking=True)
            seqs = torch.tensor(decode_b, dtype=torch.int64).to(device, non_blocking=True)
            max_len = max(batch.seq_lens_cpu[b] for b in decode_b)
        tile_seq = tile_m0 = None
        num_tiles = 0
        if prefill_b:
            tile_seq, tile_m0 = prefill_tiles(q_lens, prefill_b, device, PREFILL_BLOCK_M)
            num_tiles = int(tile_seq.shape[0])
        return TritonAttentionMetadata(rows, seqs, max_len, tile_seq, tile_m0, len(decode_b), num_tiles)

    def _row_decode_metadata(self, batch) -> TritonAttentionMetadata:
        """Sequences whose rows run as decodes (all, or those with drafts) get one decode row per query row, the
        keys up to its own position; the others keep the plain split."""
        device = batch.input_ids.device
        q_lens, s_lens = batch.query_lens_cpu, batch.seq_lens_cpu
        drafts = batch.draft_lens_cpu or [0] * len(q_lens)
        rows, seqs, lens, prefill_b, acc = [], [], [], [], 0
        for b, n in enumerate(q_lens):
            if n == 1 or drafts[b] or self.rows_as_decodes:
                rows.extend(range(acc, acc + n))
                seqs.extend([b] * n)
                lens.extend(range(s_lens[b] - n + 1, s_lens[b] + 1))
            else:
                prefill_b.append(b)
            acc += n
        seq_index = torch.tensor(seqs, dtype=torch.int64).to(device, non_blocking=True)
        meta = TritonAttentionMetadata(
            torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True),
            torch.arange(len(rows), dtype=torch.int64, device=device), max(lens), None, None, len(rows), 0,
            batch.block_tables.index_select(0, seq_index), torch.tensor(lens, dtype=torch.int64).to(device))
        if prefill_b:
            meta.tile_seq, meta.tile_m0 = prefill_tiles(q_lens, prefill_b, device, PREFILL_BLOCK_M)
            meta.num_prefill_tiles = int(meta.tile_seq.shape[0])
        return meta

    # A mixed step's static inputs cut prompt chunks into tiles of this many rows (worker/mixed_graph.py).
    mixed_tile_rows = PREFILL_BLOCK_M

    def build_mixed_graph_metadata(self, inputs, tokens: int, max_seq_len: int) -> TritonAttentionMetadata:
        """Metadata of a mixed step captured in a CUDA graph (worker/mixed_graph.py's StaticMixedInputs for the
        bucket of `tokens` rows): every one of its max_seqs decode entries runs (padding ones read one key of the
        padding sequence and write the padding row), and every prefill tile (padding ones name a sequence without
        rows); the split-K grid is sized for `max_seq_len`."""
        if self.rows_as_decodes:
            raise ValueError("batch-invariant attention runs every row as a decode: no mixed-step graphs")
        tiles = inputs.tiles_for(tokens)
        return TritonAttentionMetadata(inputs.decode_rows, inputs.decode_seqs, max_seq_len, inputs.tile_seq[:tiles],
                                       inputs.tile_m0[:tiles], inputs.max_seqs, tiles)

    def build_graph_metadata(self, batch, max_seq_len: int) -> TritonAttentionMetadata:
        """Metadata of a decode-only batch captured in a CUDA graph: every row decodes, and the split-K grid is
        sized for `max_seq_len` (the longest context the engine allows), so one graph serves any context."""
        rows = torch.arange(batch.num_seqs, dtype=torch.int64, device=batch.input_ids.device)
        return TritonAttentionMetadata(rows, rows, max_seq_len, None, None, batch.num_seqs, 0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, batch,
                scale: float, rotary=None, qk_norm=None) -> torch.Tensor:
        meta = batch.attn_metadata
        if not isinstance(meta, TritonAttentionMetadata):
            meta = self.build_metadata(batch)
        norm_weights = _fusable_qk_norm(qk_norm, q) if rotary is not None else None
        if qk_norm is not None and norm_weights is None:
            q, k = qk_norm[0](q), qk_norm[1](k)
        if rotary is not None:
            # One launch (normalises q and k per head with qk_norm,) rotates q (into a new tensor) and k, and writes
            # k and v: the rotated k is only read back from the cache.
            q = rotary_write_kv(kv_cache, q, k, v, batch.slot_mapping, batch.positions, rotary.cos_cache,
                                rotary.sin_cache, inputs_ready=True, qk_norm=norm_weights)
        else:
            if q.stride(-1) != 1:
                q = q.contiguous()
            write_kv(kv_cache, k, v, batch.slot_mapping)
        return self._attend(q, kv_cache, batch, meta, scale)

    def attend_cached(self, q: torch.Tensor, kv_cache: torch.Tensor, batch, scale: float) -> torch.Tensor:
        """`forward` once this step's keys and values are in the cache already (the batch-1 fused qkv projection
        wrote them: kernels/qkv_rotary.py); q [T, H, D] is rotated."""
        meta = batch.attn_metadata
        return self._attend(q, kv_cache, batch, meta if isinstance(meta, TritonAttentionMetadata)
                            else self.build_metadata(batch), scale)

    def _attend(self, q, kv_cache, batch, meta: TritonAttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            per_row = meta.row_block_tables is not None
            decode_attention(q, kv_cache, meta.row_block_tables if per_row else batch.block_tables,
                             meta.row_seq_lens if per_row else batch.seq_lens, scale, out=out,
                             q_rows=meta.decode_rows, seq_ids=meta.decode_seqs, max_seq_len=meta.decode_max_len,
                             num_splits=self.num_splits, inputs_ready=True)
        if meta.num_prefill_tiles:
            prefill_attention(q, kv_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, scale,
                              meta.tile_seq, meta.tile_m0, out=out)
        return out


def _fusable_qk_norm(qk_norm, q: torch.Tensor) -> Optional[tuple[torch.Tensor, torch.Tensor, float]]:
    """(q weight, k weight, eps) when rotary_write_kv can apply the per-head norms itself: weights in q's dtype (the
    reference's output dtype is then q's) and one eps; None otherwise (or without norms)."""
    if qk_norm is None:
        return None
    q_norm, k_norm = qk_norm
    if q_norm.weight.dtype != q.dtype or k_norm.weight.dtype != q.dtype or q_norm.eps != k_norm.eps:
        return None
    return q_norm.weight, k_norm.weight, q_norm.eps


__all__ = ["TritonPagedAttention", "TritonAttentionMetadata"]
