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

from deepserve import envs
from deepserve.kernels.kv_write import rotary_write_kv, write_kv
from deepserve.kernels.paged_attention import decode_attention
from deepserve.kernels.paged_prefill import PREFILL_BLOCK_M, prefill_attention, prefill_tiles


@dataclass
class TritonAttentionMetadata:
    decode_rows: Optional[torch.Tensor]   # [Bd] int32 (int64) rows of q that are decodes (None: no decodes)
    decode_seqs: Optional[torch.Tensor]   # [Bd] int32 (int64) their sequence index in the batch
    decode_max_len: int                   # longest decode context (host int: sizes the split)
    tile_seq: Optional[torch.Tensor]      # [num_tiles] int32 prefill tiles: sequence index
    tile_m0: Optional[torch.Tensor]       # [num_tiles] int32 first query row of the tile within its sequence
    num_decodes: int
    num_prefill_tiles: int
    # Rows run as decodes of their own length (see `rows_as_decodes`): per-row tables and lengths (None: per sequence)
    row_block_tables: Optional[torch.Tensor] = None
    row_seq_lens: Optional[torch.Tensor] = None
    # int32 copies of what the decode kernel reads per sequence (or per row), made once per forward by
    # `TritonPagedAttention.begin_forward`; None: the batch's own (int64) tensors.
    decode_tables: Optional[torch.Tensor] = None
    decode_lens: Optional[torch.Tensor] = None
    decode_rows_i32: Optional[torch.Tensor] = None     # of int64 decode_rows / decode_seqs (a mixed graph's buffers)
    decode_seqs_i32: Optional[torch.Tensor] = None


# From this many decode rows a forward reads int32 copies of the block tables and sequence lengths (two conversion
# launches a step). With the int64 tensors a step's inputs come as, the paged decode kernel of Llama-3-8B at batch
# 64 and 1k context took 91 us a layer against 70 with the same values in int32, on an H200, on the engine's own
# cache and inputs (benchmarks/decode_attention_engine_inputs.py, decode_attention_engine_inputs_h200.json); at
# batch 32 the kernel ran as fast in the step (int64) as alone (int32). Small batches keep the int64 tensors and
# skip the launches.
INT32_DECODE_INPUTS_MIN_ROWS = 16


class TritonPagedAttention:
    """GPU backend: Triton kernels with the reference backend's metadata needs (ForwardBatch fields only)."""

    def __init__(self, num_splits: Optional[int] = None, rows_as_decodes: bool = False) -> None:
        """`rows_as_decodes` (batch-invariant mode): every query row runs through the decode kernel as a sequence of
        its own length, never the prefill kernel, and without split-K, so a row's keys are reduced in one order
        whatever the batch, the chunking or the cache hits (deepinfer.md section 9). Rows of a decode verifying
        drafts always run so (speculative decoding: they are decodes one position apart)."""
        self.rows_as_decodes = rows_as_decodes
        # None: the split rule (tests, and DEEPSERVE_DECODE_SPLITS for A/Bs, may force a count)
        self.num_splits = 1 if rows_as_decodes else (num_splits or envs.DEEPSERVE_DECODE_SPLITS or None)

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
            rows = torch.tensor([starts[b] for b in decode_b], dtype=torch.int32).to(device, non_blocking=True)
            seqs = torch.tensor(decode_b, dtype=torch.int32).to(device, non_blocking=True)
            max_len = max(batch.seq_lens_cpu[b] for b in decode_b)
        tile_seq = tile_m0 = None
        num_tiles = 0
        if prefill_b:
            tile_seq, tile_m0 = prefill_tiles(q_lens, prefill_b, device, PREFILL_BLOCK_M)
            num_tiles = int(tile_seq.shape[0])
        meta = TritonAttentionMetadata(rows, seqs, max_len, tile_seq, tile_m0, len(decode_b), num_tiles)
        self._int32_decode_inputs(meta, batch)
        return meta

    def begin_forward(self, batch) -> None:
        """Per-forward work on the step's inputs, before the layers run: the int32 decode inputs. Eager steps get
        them from `build_metadata`; a CUDA graph's captured forward calls this first (worker/cuda_graph.py), so each
        replay converts its own step's inputs (the graph's metadata is built once, at capture)."""
        meta = batch.attn_metadata
        if isinstance(meta, TritonAttentionMetadata):
            self._int32_decode_inputs(meta, batch)

    @staticmethod
    def _int32_decode_inputs(meta: TritonAttentionMetadata, batch) -> None:
        """int32 copies of the decode kernel's per-sequence (per-row) block tables and lengths, and of its row
        indices where they are int64 (a mixed graph's static buffers), from INT32_DECODE_INPUTS_MIN_ROWS rows. They
        are written before the forward's first layer, so the decode kernels may still read them before their PDL
        wait (kernels/pdl.py rule 1)."""
        if meta.num_decodes < INT32_DECODE_INPUTS_MIN_ROWS:
            return
        per_row = meta.row_block_tables is not None
        meta.decode_tables = (meta.row_block_tables if per_row else batch.block_tables).to(torch.int32)
        meta.decode_lens = (meta.row_seq_lens if per_row else batch.seq_lens).to(torch.int32)
        if meta.decode_rows.dtype != torch.int32:     # new tensors: the int64 ones are refilled every step
            meta.decode_rows_i32 = meta.decode_rows.to(torch.int32)
            meta.decode_seqs_i32 = meta.decode_seqs.to(torch.int32)

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
        self._int32_decode_inputs(meta, batch)
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
        rows = torch.arange(batch.num_seqs, dtype=torch.int32, device=batch.input_ids.device)
        return TritonAttentionMetadata(rows, rows, max_seq_len, None, None, batch.num_seqs, 0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, batch,
                scale: float, rotary=None, qk_norm=None, prefetch: Optional[torch.Tensor] = None,
                window: int = 0) -> torch.Tensor:
        meta = batch.attn_metadata
        if not isinstance(meta, TritonAttentionMetadata):
            meta = self.build_metadata(batch)
        norm_weights = _fusable_qk_norm(qk_norm, q) if rotary is not None else None
        if qk_norm is not None and norm_weights is None:
            q, k = qk_norm[0](q), qk_norm[1](k)
        if rotary is not None:
            # One launch (normalises q and k per head with qk_norm,) rotates q (into a new tensor) and k, and writes
            # k and v: the rotated k is only read back from the cache. Its extra programs ask L2 for `prefetch`.
            q = rotary_write_kv(kv_cache, q, k, v, batch.slot_mapping, batch.positions, rotary.cos_cache,
                                rotary.sin_cache, inputs_ready=True, qk_norm=norm_weights, l2_prefetch=prefetch)
        else:
            if q.stride(-1) != 1:
                q = q.contiguous()
            write_kv(kv_cache, k, v, batch.slot_mapping)
        return self._attend(q, kv_cache, batch, meta, scale, prefetch, window)

    def attend_cached(self, q: torch.Tensor, kv_cache: torch.Tensor, batch, scale: float,
                      prefetch: Optional[torch.Tensor] = None, window: int = 0) -> torch.Tensor:
        """`forward` once this step's keys and values are in the cache already (the batch-1 fused qkv projection
        wrote them: kernels/qkv_rotary.py); q [T, H, D] is rotated."""
        meta = batch.attn_metadata
        return self._attend(q, kv_cache, batch, meta if isinstance(meta, TritonAttentionMetadata)
                            else self.build_metadata(batch), scale, prefetch, window)

    def _attend(self, q, kv_cache, batch, meta: TritonAttentionMetadata, scale: float,
                prefetch: Optional[torch.Tensor] = None, window: int = 0) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.num_decodes:
            tables, lens, rows, seqs = decode_inputs(meta, batch)
            decode_attention(q, kv_cache, tables, lens, scale, out=out, q_rows=rows, seq_ids=seqs,
                             max_seq_len=meta.decode_max_len, num_splits=self.num_splits, inputs_ready=True,
                             l2_prefetch=prefetch, window=window)
        if meta.num_prefill_tiles:
            prefill_attention(q, kv_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc, scale,
                              meta.tile_seq, meta.tile_m0, out=out, window=window)
        return out


def decode_inputs(meta: TritonAttentionMetadata, batch) -> tuple[torch.Tensor, ...]:
    """(block tables, sequence lengths, q rows, sequence ids) of the step's decode rows, as the decode kernel reads
    them: per row or per sequence, the int32 copies where `begin_forward` made them."""
    per_row = meta.row_block_tables is not None
    tables = meta.row_block_tables if per_row else batch.block_tables
    lens = meta.row_seq_lens if per_row else batch.seq_lens
    if meta.decode_tables is not None:
        tables, lens = meta.decode_tables, meta.decode_lens
    if meta.decode_rows_i32 is not None:
        return tables, lens, meta.decode_rows_i32, meta.decode_seqs_i32
    return tables, lens, meta.decode_rows, meta.decode_seqs


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
