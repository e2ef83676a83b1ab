"""TritonMLA: the MLABackend of the GPU path (deepserve/layers/mla.py defines the protocol and the reference,
TorchMLA, which this must match).

Decode-only steps (every sequence brings one token) run in latent space on the GPU: W_UK absorbed into the
query with one batched GEMM over heads, the Triton decode kernel over the paged latent cache
(deepserve/kernels/mla_decode.py), W_UV applied to the weighted latents with another; the new latents are
written by a kernel that skips negative slots. Steps with prefill rows go to the reference.

TritonMLA is also a per-step metadata builder (like TritonPagedAttention): `build_metadata` gives the
reference's metadata plus the longest context (which sizes the decode split without reading host lists per
layer), `build_graph_metadata` the fixed metadata of a decode batch captured in a CUDA graph (split sized for
the longest context the engine allows). Without its metadata (e.g. the reference builder's), it still works.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from deepserve.kernels.mla_decode import mla_decode, write_latents
from deepserve.layers.attention import TorchAttentionMetadata, TorchPagedAttention
from deepserve.layers.mla import MLAWeights, TorchMLA


@dataclass
class TritonMLAMetadata(TorchAttentionMetadata):
    """The reference's fields (read on prefill/mixed steps) and the longest context of the step's decodes."""
    max_seq_len: int = 0


class TritonMLA:
    def __init__(self, num_splits: Optional[int] = None) -> None:
        self.reference = TorchMLA()
        self.num_splits = num_splits      # force the decode split count (tests); None: heuristic

    # --- per-step metadata ------------------------------------------------------------------------
    def build_metadata(self, batch) -> TritonMLAMetadata:
        longest = max(batch.seq_lens_cpu, default=1)
        if batch.is_decode_only:          # the kernel needs only the batch's own tensors
            return TritonMLAMetadata(None, None, None, [], max_seq_len=longest)
        meta = TorchPagedAttention().build_metadata(batch)
        return TritonMLAMetadata(meta.decode_rows, meta.decode_blocks, meta.decode_mask, meta.prefills,
                                 max_seq_len=longest)

    def build_graph_metadata(self, batch, max_seq_len: int) -> TritonMLAMetadata:
        return TritonMLAMetadata(None, None, None, [], max_seq_len=max_seq_len)

    # --- per layer --------------------------------------------------------------------------------
    def forward(self, q_nope, q_pe, latent, k_pe, kv_cache, weights: MLAWeights, batch, scale):
        if q_nope.shape[0] == 0 or not batch.is_decode_only:
            return self.reference.forward(q_nope, q_pe, latent, k_pe, kv_cache, weights, batch, scale)
        write_latents(kv_cache, latent, k_pe, batch.slot_mapping)
        meta = batch.attn_metadata
        longest = meta.max_seq_len if isinstance(meta, TritonMLAMetadata) else max(batch.seq_lens_cpu)
        # Decode-only: row b is sequence b's one token.
        bsz, heads, _ = q_nope.shape
        rank = weights.w_uk.shape[-1]
        q_lat = torch.bmm(q_nope.transpose(0, 1), weights.w_uk).transpose(0, 1)       # [B, H, R] view
        # Heads-major output, so the W_UV GEMM reads it without a copy.
        out_lat = torch.empty(heads, bsz, rank, dtype=q_nope.dtype, device=q_nope.device)
        mla_decode(q_lat, q_pe, kv_cache, batch.block_tables, batch.seq_lens, scale, out=out_lat.transpose(0, 1),
                   max_seq_len=longest, num_splits=self.num_splits)
        return torch.bmm(out_lat, weights.w_uv.transpose(1, 2)).transpose(0, 1)        # [B, H, v]


__all__ = ["TritonMLA", "TritonMLAMetadata"]
