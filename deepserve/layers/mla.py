"""Multi-head latent attention (DeepSeek-V2/V3), its paged cache and its PyTorch reference backend.

Per token, `kv_a_proj_with_mqa` makes one compressed latent c (kv_lora_rank dims, RMS-normed) and one
RoPE key k_pe (qk_rope_head_dim dims) shared by all heads. `kv_b_proj` expands c into every head's
no-RoPE key and its value: k_nope[h] = W_UK[h] c, v[h] = W_UV[h] c. The cache keeps only [c | k_pe]:
(kv_lora_rank + qk_rope_head_dim) values per token per layer, instead of heads * (key + value dims).

Two ways to attend over that cache, equal in exact arithmetic:
  expanded  (prefill): rebuild k_nope, v of every visible token through kv_b_proj, then ordinary attention.
  absorbed  (decode):  fold W_UK into the query (q_lat = q_nope W_UK) and W_UV into the output, so scores
                       and the weighted sum run in latent space: one query against T cached latents costs
                       O(T * (kv_lora_rank + rope)) per head, and nothing per token is expanded.

RoPE follows HF's DeepSeek code: interleaved pairs (x0, x1), (x2, x3), ... (`rope_interleave`, always for
V2) or NeoX halves; YaRN scaling with DeepSeek's mscale both on cos/sin (attention_factor) and on the
softmax scale (mscale_all_dim).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from deepserve.kernels.reference.attention import write_latents
from deepserve.layers.attention import gather_blocks
from deepserve.layers.kernel_dispatch import use_triton
from deepserve.layers.linear import Linear, fused_two_linear, linear
from deepserve.layers.norm import RMSNorm
from deepserve.layers.rank_group import SINGLE, RankGroup
from deepserve.layers.tensor_parallel import narrow_parameter, shard_column, shard_row, split_evenly
from deepserve.layers.rotary import rope_inv_freq, yarn_mscale
from deepserve.layers.forward_batch import ForwardBatch

# --- RoPE: config, YaRN, rotation -----------------------------------------------------------------

def mla_softmax_scale(qk_head_dim: int, params: dict[str, Any]) -> float:
    """1/sqrt(d), times mscale(factor, mscale_all_dim)^2 under YaRN (HF's `yarn_apply_mscale`)."""
    scale = qk_head_dim ** -0.5
    mscale_all_dim = params.get("mscale_all_dim")
    if params["rope_type"] != "default" and mscale_all_dim:
        scale *= yarn_mscale(params["factor"], mscale_all_dim) ** 2
    return scale


class MLARotaryEmbedding(nn.Module):
    """RoPE over the trailing qk_rope_head_dim dims of q and the shared k_pe.

    cos/sin caches are [max_position, rope_dim / 2] (one column per angle). On CUDA tensors `forward` runs one
    Triton launch for q and k (deepserve/kernels/rotary.py reads these half-width caches and de-interleaves
    in the same pass); elsewhere it runs `reference`, the PyTorch path the kernel is tested against."""

    def __init__(self, rope_dim: int, max_position: int, params: dict[str, Any], max_position_embeddings: int,
                 interleaved: bool) -> None:
        super().__init__()
        inv_freq, attention_factor = rope_inv_freq(rope_dim, params, max_position_embeddings)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.interleaved = interleaved
        self.register_buffer("cos_cache", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * attention_factor, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, rope_dim], k: [T, Hk, rope_dim] (strided views are fine) -> rotated copies, in their dtypes."""
        if use_triton(q):
            from deepserve.kernels.rotary import apply_rotary
            return apply_rotary(positions, q, k, self.cos_cache, self.sin_cache, interleaved=self.interleaved)
        return self.reference(positions, q), self.reference(positions, k)

    def reference(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, rope_dim] -> rotated, in x's dtype (PyTorch, float32 math)."""
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        xf = x.float()
        if self.interleaved:
            # Pair (2i, 2i+1) turns by angle i. Gathering evens then odds turns it into the NeoX layout; the
            # result stays in that layout (as HF's V3 code leaves it), which q and k share, so q.k is unchanged.
            xf = torch.cat((xf[..., 0::2], xf[..., 1::2]), dim=-1)
        x1, x2 = xf.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


# --- attention over the latent cache --------------------------------------------------------------

@dataclass
class MLAWeights:
    """kv_b_proj viewed per head: W_UK [H, nope, r] (keys) and W_UV [H, v, r] (values); `kv_b` is the whole
    weight [H * (nope + v), r] they are views of (None: rebuilt from them, a copy)."""
    w_uk: torch.Tensor
    w_uv: torch.Tensor
    kv_b: torch.Tensor | None = None

    def stacked(self) -> torch.Tensor:
        """[H * (nope + v), r], head h's rows = [W_UK[h]; W_UV[h]]: one GEMM expands latents into
        [tokens, H, nope + v] (k_nope then v per head)."""
        if self.kv_b is not None:
            return self.kv_b
        return torch.cat((self.w_uk, self.w_uv), dim=1).flatten(0, 1)


class MLABackend(Protocol):
    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                kv_cache: torch.Tensor, weights: MLAWeights, batch: ForwardBatch, scale: float,
                rotary: MLARotaryEmbedding | None = None, latent_norm: RMSNorm | None = None) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope]; this step's latent [T, r] and k_pe [T, rope] (written to
        the cache at batch.slot_mapping); kv_cache [num_blocks, block_size, r + rope] -> [T, H, v]. With
        `rotary`, q_pe and k_pe are first rotated at batch.positions; with `latent_norm` (kv_a_layernorm) the
        latent is normalised before it is written: a backend may fuse both with its cache write."""
        ...


class TorchMLA:
    """Reference backend. Reads the per-step metadata of `TorchPagedAttention.build_metadata` (decode rows
    with their block tables, prefill segments), which does not depend on what a slot holds."""

    def forward(self, q_nope, q_pe, latent, k_pe, kv_cache, weights, batch, scale, rotary=None, latent_norm=None):
        meta = batch.attn_metadata
        rank = latent.shape[-1]
        if latent_norm is not None:
            latent = latent_norm(latent)
        if rotary is not None:
            q_pe, k_pe = rotary(batch.positions, q_pe, k_pe.unsqueeze(1))
            k_pe = k_pe.squeeze(1)
        write_latents(kv_cache, latent, k_pe, batch.slot_mapping)
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], weights.w_uv.shape[1])
        if meta.decode_rows is not None:
            rows = meta.decode_rows
            cached = gather_blocks(kv_cache, meta.decode_blocks).flatten(1, 2)   # [Bd, max_blocks * bs, r + rope]
            out[rows] = absorbed_attention(q_nope[rows], q_pe[rows], cached, meta.decode_mask, weights, rank, scale)
        for seg in meta.prefills:
            rows = slice(seg.row_start, seg.row_start + seg.num_rows)
            cached = gather_blocks(kv_cache, seg.blocks).flatten(0, 1)[: seg.seq_len]   # [L, r + rope]
            cached = cached.to(q_nope.dtype)       # a cache of another dtype (fp8) widens here
            out[rows] = expanded_attention(q_nope[rows], q_pe[rows], cached, seg.first_position, weights, rank,
                                            scale)
        return out


def absorbed_attention(q_nope, q_pe, cached, mask, weights: MLAWeights, rank: int, scale: float):
    """One query per sequence, attending in latent space. q_nope [B, H, nope], q_pe [B, H, rope],
    cached [B, L, r + rope], mask [B, L] -> [B, H, v]."""
    q_latent = torch.einsum("bhn,hnr->bhr", q_nope.float(), weights.w_uk.float())
    query = torch.cat((q_latent, q_pe.float()), dim=-1)                    # [B, H, r + rope]
    cached = cached.float()
    scores = torch.matmul(query, cached.transpose(1, 2)) * scale           # [B, H, L]
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    out_latent = torch.matmul(torch.softmax(scores, dim=-1), cached[..., :rank])    # [B, H, r]
    return torch.einsum("bhr,hvr->bhv", out_latent, weights.w_uv.float()).to(q_nope.dtype)


def expanded_attention(q_nope, q_pe, cached, first_position: int, weights: MLAWeights, rank: int, scale: float):
    """A prefill segment: q [n, H, .] at positions first_position.. over its L cached tokens -> [n, H, v]."""
    n, heads, _ = q_nope.shape
    latent, k_pe = cached[:, :rank], cached[:, rank:]
    k_nope = torch.einsum("lr,hnr->hln", latent, weights.w_uk)             # [H, L, nope]
    values = torch.einsum("lr,hvr->hlv", latent, weights.w_uv)             # [H, L, v]
    keys = torch.cat((k_nope, k_pe[None].expand(heads, -1, -1)), dim=-1)
    query = torch.cat((q_nope, q_pe), dim=-1).transpose(0, 1)              # [H, n, nope + rope]
    if first_position == 0:
        out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale)
    else:
        key_pos = torch.arange(keys.shape[1], device=query.device)
        query_pos = torch.arange(first_position, first_position + n, device=query.device)
        out = F.scaled_dot_product_attention(query, keys, values, attn_mask=key_pos[None, :] <= query_pos[:, None],
                                             scale=scale)
    return out.transpose(0, 1)


class MLAAttention(nn.Module):
    """One layer's latent cache holder (bound by the model runner) and its backend."""

    kv_block_dim = 0   # the block index's dimension in kv_cache_shape

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.kv_lora_rank, self.rope_dim, self.scale = num_heads, kv_lora_rank, rope_dim, scale
        self.kv_cache: torch.Tensor | None = None
        self.backend: MLABackend = TorchMLA()

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.kv_lora_rank + self.rope_dim)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return (self.kv_lora_rank + self.rope_dim) * torch.empty(0, dtype=dtype).element_size()

    def forward(self, q_nope, q_pe, latent, k_pe, weights: MLAWeights, batch: ForwardBatch,
                rotary: MLARotaryEmbedding | None = None, latent_norm: RMSNorm | None = None) -> torch.Tensor:
        assert self.kv_cache is not None, "the model runner binds a KV cache before the first forward"
        return self.backend.forward(q_nope, q_pe, latent, k_pe, self.kv_cache, weights, batch, self.scale,
                                    rotary=rotary, latent_norm=latent_norm)


class MultiHeadLatentAttention(nn.Module):
    """The projections around MLAAttention; parameter names are HF's, so checkpoints load one to one."""

    def __init__(self, cfg: dict[str, Any], rotary: MLARotaryEmbedding, scale: float) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.num_heads = cfg["num_attention_heads"]
        self.nope_dim, self.rope_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        self.v_dim, self.kv_lora_rank = cfg["v_head_dim"], cfg["kv_lora_rank"]
        self.q_lora_rank = cfg.get("q_lora_rank")
        bias = bool(cfg.get("attention_bias", False))
        q_size = self.num_heads * (self.nope_dim + self.rope_dim)
        # HF builds these two inner norms with the default eps, not rms_norm_eps.
        if self.q_lora_rank:
            self.q_a_proj = Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6)
            self.q_b_proj = Linear(self.q_lora_rank, q_size, bias=False)
        else:
            self.q_proj = Linear(hidden, q_size, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6)
        self.kv_b_proj = LatentUpProjection(self.num_heads, self.nope_dim, self.v_dim, self.kv_lora_rank)
        self.o_proj = Linear(self.num_heads * self.v_dim, hidden, bias=bias)
        self.rotary = rotary
        self.attn = MLAAttention(self.num_heads, self.kv_lora_rank, self.rope_dim, scale)
        # Tensor parallelism (shard_tensor_parallel): this rank's heads' o_proj output is summed over `tp`.
        self.tp: RankGroup = SINGLE
        # [q rows; kv_a rows] in one tensor, whose views the two Linears' weights become (stack_input_projections).
        self.input_projections: torch.Tensor | None = None

    def shard_tensor_parallel(self, tp: RankGroup) -> None:
        """After loading: keep this rank's 1 / tp.size of the heads. q_proj / q_b_proj and kv_b_proj by heads (their
        rows), o_proj by heads * v_head_dim (its columns); q_a_proj, kv_a_proj_with_mqa and the norms stay whole, so
        the latent cache [c | k_pe] is the same on every rank. Nothing is derived from kv_b_proj at load
        (`per_head()` views it each forward), so there is nothing to recompute."""
        local = split_evenly(self.num_heads, tp, "num_attention_heads")
        q_head = self.nope_dim + self.rope_dim
        shard_column(self.q_b_proj if self.q_lora_rank else self.q_proj, [(tp.rank * local * q_head, local * q_head)])
        kv_head = self.nope_dim + self.v_dim
        narrow_parameter(self.kv_b_proj.weight, 0, [(tp.rank * local * kv_head, local * kv_head)])
        shard_row(self.o_proj, (tp.rank * local * self.v_dim, local * self.v_dim), tp)
        self.num_heads = self.kv_b_proj.num_heads = self.attn.num_heads = local
        self.tp = tp

    def stack_input_projections(self) -> bool:
        """After loading (and sharding, quantizing): put the weights of the two projections that read x (q_proj or
        q_a_proj, and kv_a_proj_with_mqa) in one [q rows + kv_a rows, hidden] tensor and make each Linear's weight
        a view of it, so that a step past the fused launches' rows (fused_two_linear: 1-32 rows) runs one GEMM for
        both, not two (DeepSeek-V2-Lite: 3072 + 576 rows of 2048; cuBLAS took ~6 us at 64-256 rows for kv_a's
        2.4 MB alone, a launch's fixed cost). No memory is added: the old tensors are freed. Only for two plain
        Linears without bias of one dtype (not quantized, not batch-invariant); returns whether it stacked."""
        q_first = self.q_a_proj if self.q_lora_rank else self.q_proj
        kv_a = self.kv_a_proj_with_mqa
        layers = (q_first, kv_a)
        if not all(type(layer) is Linear and not layer.batch_invariant and layer.bias is None for layer in layers):
            return False
        if q_first.weight.dtype != kv_a.weight.dtype or q_first.weight.device != kv_a.weight.device:
            return False
        stacked = torch.cat((q_first.weight.detach(), kv_a.weight.detach()))
        rows = q_first.weight.shape[0]
        q_first.weight = nn.Parameter(stacked[:rows], requires_grad=False)
        kv_a.weight = nn.Parameter(stacked[rows:], requires_grad=False)
        self.input_projections = stacked
        return True

    def project_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_proj(x) or q_a_proj(x), kv_a_proj_with_mqa(x)): one launch where it can (the fused GEMV / skinny GEMM
        at 1-32 rows on the GPU, then the stacked weight's one GEMM), else two. The results may be views of one
        [T, q + kv_a] tensor (row stride past their width): every consumer takes a row stride."""
        q_first = self.q_a_proj if self.q_lora_rank else self.q_proj
        both = fused_two_linear(x, q_first, self.kv_a_proj_with_mqa)
        if both is not None:
            return both
        if self.input_projections is not None:
            return linear(x, self.input_projections).split(
                [q_first.weight.shape[0], self.kv_a_proj_with_mqa.weight.shape[0]], dim=-1)
        return q_first(x), self.kv_a_proj_with_mqa(x)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q, kv_a = self.project_inputs(x)
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q_nope, q_pe = q.view(t, self.num_heads, -1).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = kv_a.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        # The attention applies kv_a_layernorm to the latent and the rotary embedding to q_pe and k_pe: the GPU
        # backend fuses both with the cache write (the latent is only read back from the cache).
        out = self.attn(q_nope, q_pe, latent, k_pe, self.kv_b_proj.per_head(), batch, rotary=self.rotary,
                        latent_norm=self.kv_a_layernorm)
        return self.tp.all_reduce(self.o_proj(out.reshape(t, self.num_heads * self.v_dim)))


class LatentUpProjection(nn.Module):
    """HF's `kv_b_proj` weight [H * (nope + v), kv_lora_rank]. Never applied as a Linear (the backend uses
    its per-head blocks, expanded or absorbed), so it is not an nn.Linear: weight quantization that
    swaps Linears leaves it alone."""

    def __init__(self, num_heads: int, nope_dim: int, v_dim: int, kv_lora_rank: int) -> None:
        super().__init__()
        self.num_heads, self.nope_dim, self.v_dim = num_heads, nope_dim, v_dim
        self.weight = nn.Parameter(torch.empty(num_heads * (nope_dim + v_dim), kv_lora_rank))

    def per_head(self) -> MLAWeights:
        blocks = self.weight.view(self.num_heads, self.nope_dim + self.v_dim, -1)
        w_uk, w_uv = blocks.split([self.nope_dim, self.v_dim], dim=1)
        return MLAWeights(w_uk, w_uv, self.weight)
