"""TritonMLA: the MLABackend of the GPU path (deepserve/layers/mla.py defines the protocol and the reference,
TorchMLA, which this must match).

Every step writes the new latents with a kernel that skips negative slots (given the layer's rotary embedding, the
same kernel rotates q_pe and k_pe: one launch), then:
  decode rows (one query token) run in latent space: W_UK absorbed into the query with one batched GEMM over
    heads, the Triton decode kernel over the paged latent cache (deepserve/kernels/mla_decode.py), W_UV applied
    to the weighted latents with another; in a mixed step on the decode rows' subset, gathered by index;
  prefill rows (whole prompts, chunks, prompts over a cached prefix) run expanded, all sequences at once
    (deepserve/kernels/mla_prefill.py): one gather of their visible latents, one GEMM through kv_b_proj, one
    varlen causal attention launch.

TritonMLA is also the per-step metadata builder (like TritonPagedAttention). `build_metadata` reads only the
batch's host lists (no device -> host sync) and uploads every index tensor the layers share in one copy;
`build_graph_metadata` gives the fixed metadata of a decode batch captured in a CUDA graph (split sized for the
longest context the engine allows). With another builder's metadata (e.g. the reference's), decode-only steps
still run here and other steps go to the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepserve import envs
from deepserve.kernels.mla_absorb import absorb_query, absorb_supported, expand_values, use_mma
from deepserve.kernels.mla_decode import mla_decode, rotary_write_latents, write_latents
from deepserve.kernels.mla_prefill import MLAPrefillPlan, mla_prefill, plan_prefill
from deepserve.layers.mla import MLAWeights, TorchMLA
from deepserve.layers.forward_batch import upload_int64

# A/B switch (DEEPSERVE_MLA_ABSORB_MMA=0): decode batches past the GEMVs' rows keep cuBLAS's bmm pair.
_ABSORB_MMA = envs.DEEPSERVE_MLA_ABSORB_MMA


@dataclass
class TritonMLAMetadata:
    """Per-step metadata. Decode-only steps (and CUDA graphs) need only `max_seq_len`: row b is sequence b."""
    max_seq_len: int = 0                           # longest context of the decode rows (sizes the split)
    decode_rows: torch.Tensor | None = None        # mixed steps: [Bd] rows of q that are decodes
    decode_tables: torch.Tensor | None = None      # [Bd, max_blocks] their block tables
    decode_seq_lens: torch.Tensor | None = None    # [Bd] their context lengths
    prefill: MLAPrefillPlan | None = None          # steps with prefill rows


class TritonMLA:
    def __init__(self, num_splits: int | None = None) -> None:
        self.reference = TorchMLA()
        self.num_splits = num_splits      # force the decode split count (tests); None: heuristic

    # --- per-step metadata ------------------------------------------------------------------------
    def build_metadata(self, batch) -> TritonMLAMetadata:
        q_lens, s_lens = batch.query_lens_cpu, batch.seq_lens_cpu
        if batch.is_decode_only:          # the kernel needs only the batch's own tensors
            return TritonMLAMetadata(max(s_lens, default=1))
        decode_seqs = [b for b, n in enumerate(q_lens) if n == 1]
        starts = [0]
        for n in q_lens:
            starts.append(starts[-1] + n)
        layout = plan_prefill(q_lens, s_lens, batch.block_size)
        rows, seqs, *prefill = upload_int64([[starts[b] for b in decode_seqs], decode_seqs] + layout.parts(),
                                       batch.input_ids.device)
        meta = TritonMLAMetadata(max((s_lens[b] for b in decode_seqs), default=0),
                                 prefill=layout.on_device(prefill, batch.block_tables))
        if decode_seqs:
            meta.decode_rows = rows
            meta.decode_tables = batch.block_tables.index_select(0, seqs)
            meta.decode_seq_lens = batch.seq_lens.index_select(0, seqs)
        return meta

    def build_graph_metadata(self, batch, max_seq_len: int) -> TritonMLAMetadata:
        return TritonMLAMetadata(max_seq_len)

    # --- per layer --------------------------------------------------------------------------------
    def forward(self, q_nope, q_pe, latent, k_pe, kv_cache, weights: MLAWeights, batch, scale, rotary=None,
                latent_norm=None):
        meta = batch.attn_metadata
        decode_only = batch.is_decode_only
        if q_nope.shape[0] == 0 or (not decode_only and not isinstance(meta, TritonMLAMetadata)):
            return self.reference.forward(q_nope, q_pe, latent, k_pe, kv_cache, weights, batch, scale, rotary,
                                          latent_norm)
        if rotary is None:
            if latent_norm is not None:
                latent = latent_norm(latent)
            write_latents(kv_cache, latent, k_pe, batch.slot_mapping)
        else:
            # One launch normalises the latent, rotates q_pe (into a new tensor) and k_pe, and writes
            # [latent | k_pe]: the normalised latent and the rotated k_pe are only read back from the cache.
            q_pe = rotary_write_latents(kv_cache, q_pe, latent, k_pe, batch.slot_mapping, batch.positions,
                                        rotary.cos_cache, rotary.sin_cache, rotary.interleaved,
                                        None if latent_norm is None else latent_norm.weight,
                                        0.0 if latent_norm is None else latent_norm.eps, inputs_ready=True)
        if decode_only:
            # Row b is sequence b's one token.
            longest = meta.max_seq_len if isinstance(meta, TritonMLAMetadata) else max(batch.seq_lens_cpu)
            return self._decode(q_nope, q_pe, kv_cache, weights, batch.block_tables, batch.seq_lens, longest, scale)
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], weights.w_uv.shape[1])
        if meta.decode_rows is not None:
            rows = meta.decode_rows
            out[rows] = self._decode(q_nope.index_select(0, rows), q_pe.index_select(0, rows), kv_cache, weights,
                                     meta.decode_tables, meta.decode_seq_lens, meta.max_seq_len, scale)
        mla_prefill(q_nope, q_pe, kv_cache, weights.stacked(), meta.prefill, batch.query_start_loc, batch.seq_lens,
                    scale, out)
        return out

    def _decode(self, q_nope, q_pe, kv_cache, weights: MLAWeights, block_tables, seq_lens, longest: int, scale):
        """One query per sequence: row b of q_nope [B, H, nope] / q_pe [B, H, rope] is sequence b of block_tables
        / seq_lens -> [B, H, v], contiguous."""
        bsz, heads, _ = q_nope.shape
        rank = weights.w_uk.shape[-1]
        # Up to MAX_MMA_BATCH rows the two per-head weight products are Triton kernels that read W_UK / W_UV once
        # and start under PDL (GEMVs at one or two rows, tensor-core GEMMs above), not cuBLAS's batched GEMMs
        # (kernels/mla_absorb.py has the numbers).
        on_triton = (absorb_supported(bsz) and weights.w_uk.dtype == q_nope.dtype
                     and (_ABSORB_MMA or not use_mma(bsz)))
        if on_triton:
            q_lat = absorb_query(q_nope, weights.w_uk)                                  # [B, H, R]
        else:
            q_lat = torch.bmm(q_nope.transpose(0, 1), weights.w_uk).transpose(0, 1)   # [B, H, R] view
        # Heads-major output, so the W_UV GEMM reads it without a copy.
        out_lat = torch.empty(heads, bsz, rank, dtype=q_nope.dtype, device=q_nope.device)
        mla_decode(q_lat, q_pe, kv_cache, block_tables, seq_lens, scale, out=out_lat.transpose(0, 1),
                   max_seq_len=longest, num_splits=self.num_splits, inputs_ready=True)
        # The W_UV product writes [B, H, v] through a heads-major view (cuBLAS takes the row stride), so the layer's
        # reshape to [B, H * v] for o_proj is a view: a [H, B, v] result would be copied there, once per layer.
        out = torch.empty(bsz, heads, weights.w_uv.shape[1], dtype=q_nope.dtype, device=q_nope.device)
        if on_triton:
            expand_values(out_lat.transpose(0, 1), weights.w_uv, out)
        else:
            torch.bmm(out_lat, weights.w_uv.transpose(1, 2), out=out.transpose(0, 1))
        return out


__all__ = ["TritonMLA", "TritonMLAMetadata"]
