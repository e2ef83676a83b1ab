"""DeepSeek-V4.1-Flash (`DeepseekV41ForCausalLM`, text path), paged and batched: deepinfer.md §2, §16.

    x0 = embed[ids]; R = x0 in m streams                                   mHC trunk [T, m, H]   (§2.4)
    per layer l:  [Engram(R)]                                                                  (§2.9)
                  R = HC(attn):  u = pre·R -> attn_norm -> SparseLatentAttention -> post/C mix   (§2.5-§2.7)
                  R = HC(ffn):   u = pre·R -> ffn_norm  -> MoE (sqrt-softplus, SwiGLU clamp)    (§2.8)
    h = shifted ? pre_last·R : HCHead(R);  hidden = norm(h) of the rows that need logits       (§2.3)

The per-layer roles (window / C1 / C2, KV / index / index-K sources, candidate blocks, the YOCO split) come from
`DeepseekV41Config`; every difference from DeepSeek-V4 is a field there. Each layer's state is paged in the
engine's blocks (layers/paged_state.py): compressed entries on the block table, per-position states (SWA keys,
compressor states, token ids) in the window pool, of which a sequence keeps `window_reach()` positions back;
`attention_layers()` lists each state once (shared layers alias their source's), which is what the model runner
sizes, allocates and copies.

Checkpoints: the released format (FP8 with 32x32 UE8M0 scales, FP4 experts; deepserve/loader/
deepseek_v41_weights.py) or the same names unquantized. DSpark draft blocks (`mtp.*`) are loaded and kept; with
`enable_dspark()` (speculative_config method "dspark") every forward also writes their main-cache keys (§2.10), and
`draft_hidden` / `draft_base_logits` / `draft_step` run the draft blocks (spec_decode/dspark.py drives them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from deepserve.layers.compressor import GatedPoolCompressor
from deepserve.layers.compressor_v4 import CSACompressor, HCACompressor, indexer_key_compressor
from deepserve.layers.embedding import Embedding
from deepserve.layers.hash_router import HashRouter, hash_routing_config
from deepserve.layers.forward_batch import ForwardBatch
from deepserve.layers.hyper_connection import HyperConnection, HyperHead, combine_streams, first_pre, write_back
from deepserve.layers.linear import Linear, linear
from deepserve.layers.moe import FusedMoE, RoutingConfig, copy_checked
from deepserve.layers.norm import RMSNorm
from deepserve.layers.paged_state import PagedState, sequence_layouts
from deepserve.layers.sparse_attention import (AttentionShape, InterleavedRope, LayerRoles, ModelStep,
                                               SparseLatentAttention, Yarn)
from deepserve.models.deepseek_v41_config import CSA, DeepseekV41Config
from deepserve.models.deepseek_v4_config import deepseek_v4_config
from deepserve.models.yoco import yoco_from_env
from deepserve.models.engram_hashing import engram_compressed_ids, engram_compressed_vocab_size, engram_multipliers, engram_table_primes


def layer_roles(c: DeepseekV41Config, layer: int | None) -> LayerRoles:
    """A backbone layer's roles from the config's maps; layer None: a DSpark draft layer (SWA only)."""
    if layer is None:
        return LayerRoles(-1, 0, -1, -1, -1, False, False)
    return LayerRoles(layer, c.compress_ratio(layer), c.kv_map[layer], c.index_map[layer], c.index_k_map[layer],
                      c.is_sparse(layer), c.is_consumer(layer),
                      candidate_source=layer == c.candidate_source_layer_id,
                      candidate_consumer=layer in c.candidate_consumers)


def attention_shape(c: DeepseekV41Config) -> AttentionShape:
    return AttentionShape(c.hidden_size, c.num_attention_heads, c.head_dim, c.qk_rope_head_dim, c.q_lora_rank,
                          c.o_groups, c.o_lora_rank, c.sliding_window, c.rms_norm_eps, c.index_n_heads,
                          c.index_head_dim, c.index_topk, c.candidate_block_size or 0, c.candidate_topk_blocks or 0,
                          head_q_norm=c.use_qnorm)


def kv_compressor(c: DeepseekV41Config, roles: LayerRoles) -> nn.Module | None:
    """A KV source's compressor: V4.1's gated pool (C1 / C2), DeepSeek-V4's CSA (overlapping) or HCA window pool."""
    if not roles.is_kv_source:
        return None
    if not c.is_v4:
        return GatedPoolCompressor(c.hidden_size, c.head_dim, roles.ratio, c.rms_norm_eps)
    kind = CSACompressor if c.attention_types[roles.layer_id] == CSA else HCACompressor
    return kind(roles.ratio, c.hidden_size, c.head_dim, c.rms_norm_eps)


def index_key_compressor(c: DeepseekV41Config, roles: LayerRoles) -> nn.Module | None:
    """DeepSeek-V4's indexer compresses its own keys (indexer_kproj False); V4.1 projects the compressed KV."""
    if c.indexer_kproj or not roles.is_index_k_source:
        return None
    return indexer_key_compressor(roles.ratio, c.hidden_size, c.index_head_dim, c.rms_norm_eps)


class Engram(nn.Module):
    """Hashed n-gram memory added to the trunk before the attention pre-mix (§2.9). The n-gram of a row at position
    p is [c(p), c(p-1), ..., c(p-M+1)] of compressed token ids, read from the model's paged token-id state."""

    def __init__(self, c: DeepseekV41Config, layer_id: int, primes: list[list[int]]) -> None:
        super().__init__()
        m, H, M, nh, dh = c.hc_mult, c.hidden_size, c.engram_max_ngram_size, c.engram_n_heads, c.engram_head_dim
        self.m, self.H, self.M, self.eps = m, H, M, c.rms_norm_eps
        self.multipliers = engram_multipliers(c, layer_id)
        self.primes = [p for heads in primes for p in heads]                 # (n, h), n outer
        self.offsets = [sum(self.primes[:i]) for i in range(len(self.primes))]
        self.heads = nh
        self.embed = nn.Embedding(sum(self.primes), dh)
        self.wkv = Linear((M - 1) * nh * dh, (m + 1) * H, bias=False)
        self.q_weight = nn.Parameter(torch.ones(m, H))
        self.k_weight = nn.Parameter(torch.ones(m, H))

    def table_rows(self, ngrams: torch.Tensor) -> torch.Tensor:
        """ngrams [T, M] compressed ids (slot r = position p - r) -> [T, (M-1)·heads] table rows:
        hash_n = XOR_{r<n} (id_r · u_r) (int64 wrap), row = hash mod P[n][h] (Python-style) + offset[n][h]."""
        rows = []
        mix = ngrams[:, 0] * self.multipliers[0]
        for n in range(2, self.M + 1):
            mix = torch.bitwise_xor(mix, ngrams[:, n - 1] * self.multipliers[n - 1])
            for h in range(self.heads):
                i = (n - 2) * self.heads + h
                rows.append(torch.remainder(mix, self.primes[i]) + self.offsets[i])
        return torch.stack(rows, dim=1)

    def forward(self, R: torch.Tensor, ngrams: torch.Tensor) -> torch.Tensor:
        T = R.shape[0]
        kv = self.wkv(self.embed.weight[self.table_rows(ngrams)].flatten(1)).view(T, self.m + 1, self.H)
        k, v = kv[:, : self.m], kv[:, self.m]                               # keys: first m rows; value: the last
        d = (unit_rms(R, self.eps) * self.q_weight.float() * unit_rms(k, self.eps) * self.k_weight.float()
             ).sum(-1) / self.H ** 0.5                                      # [T, m]
        g = torch.sigmoid(torch.sign(d) * d.abs().clamp(min=1e-6).sqrt())
        return (R.float() + g[..., None] * v.float()[:, None, :]).to(R.dtype)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class DeepseekV41Block(nn.Module):
    """hc_attn, attn_norm, attn, hc_ffn, ffn_norm, ffn (+ engram); backbone layer `layer_id`, or a draft block."""

    def __init__(self, c: DeepseekV41Config, layer_id: int | None, rope: InterleavedRope, num_experts: int,
                 top_k: int, engram_primes: list[list[int]] | None = None) -> None:
        super().__init__()
        H, m = c.hidden_size, c.hc_mult
        self.layer_id, self.shifted = layer_id, c.hc_shifted
        self.yoco_split = layer_id is not None and layer_id == c.n_prefill_layer
        self.hc_attn = HyperConnection(m, H, c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters, c.hc_post_mult_value)
        self.hc_ffn = HyperConnection(m, H, c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters, c.hc_post_mult_value)
        self.attn_norm = RMSNorm(H, c.rms_norm_eps)
        self.ffn_norm = RMSNorm(H, c.rms_norm_eps)
        roles = layer_roles(c, layer_id)
        self.attn = SparseLatentAttention(attention_shape(c), roles, rope, kv_compressor(c, roles),
                                          index_key_compressor(c, roles))
        routing = RoutingConfig(top_k=top_k, scoring=c.scoring_func, topk_method=c.topk_method, renormalize=True,
                                scaling_factor=c.routed_scaling_factor)
        self.ffn = FusedMoE(H, c.moe_intermediate_size, num_experts, routing,
                            shared_intermediate_size=c.moe_intermediate_size * c.n_shared_experts,
                            swiglu_limit=c.swiglu_limit or None)
        # DeepSeek-V4's first layers route by token id (a fixed table), not by the gate's top-k.
        self.hash_routed = layer_id is not None and c.is_hash_moe(layer_id)
        if self.hash_routed:
            self.ffn.gate = HashRouter(H, num_experts, c.vocab_size,
                                       hash_routing_config(top_k, c.routed_scaling_factor, c.scoring_func))
        if engram_primes is not None:
            self.engram = Engram(c, layer_id, engram_primes)

    def forward(self, R: torch.Tensor, prev_pre: torch.Tensor, step: ModelStep,
                ngrams: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if hasattr(self, "engram"):
            R = self.engram(R, ngrams)

        def attention(u: torch.Tensor) -> torch.Tensor:
            a = self.attn_norm(u)
            if self.yoco_split:                  # §2.7: the shared hidden the consumer half compresses
                step.shared_hidden = a
            # A decode row is always kept (its position is the suffix's last): only prompt steps compact.
            compact = self.yoco_split and step.yoco is not None and step.yoco.compact and \
                not step.batch.is_decode_only
            return self.attn(a, step, compact_here=compact)

        def moe(u: torch.Tensor) -> torch.Tensor:
            token_ids = step.batch.input_ids if self.hash_routed else None     # (V4 has no YOCO: every row)
            return self.ffn(self.ffn_norm(u), token_ids)

        R, prev_pre = self._sublayer(R, prev_pre, self.hc_attn, attention, step)
        return self._sublayer(R, prev_pre, self.hc_ffn, moe, step)

    def _sublayer(self, R, prev_pre, hc: HyperConnection, f, step: ModelStep) -> tuple[torch.Tensor, torch.Tensor]:
        """Mix parameters from the trunk entering the sublayer; its input uses the previous sublayer's pre when
        shifted, its own otherwise; post and C are its own (§16.5). Returns (trunk, this sublayer's pre)."""
        pre, post, C = hc(R)
        y = f(combine_streams(R, prev_pre if self.shifted else pre))
        if y.shape[0] != R.shape[0]:            # YOCO compact inside f: the trunk goes on with the kept rows
            keep = step.kept_rows
            R, pre, post, C = R[keep], pre[keep], post[keep], C[keep]
        return write_back(R, y, post, C), pre


class DraftBlock(DeepseekV41Block):
    """DSpark draft block `mtp.{i}` (§2.10, §2.14): SWA-only attention with base RoPE, MoE with the dspark expert
    counts; block 0 owns main_proj / main_norm, the last owns norm, markov_head, confidence_head (+ the HC head when
    not shifted). Its SWA state holds the main-cache keys; `forward_block` runs a draft block over block rows."""

    def __init__(self, c: DeepseekV41Config, index: int, rope: InterleavedRope) -> None:
        super().__init__(c, None, rope, c.draft_n_routed_experts, c.draft_num_experts_per_tok)
        H, r = c.hidden_size, c.dspark_markov_rank
        if index == 0:
            self.main_proj = Linear(len(c.dspark_target_layer_ids) * H, H, bias=False)
            self.main_norm = RMSNorm(H, c.rms_norm_eps)
        if index == c.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(H, c.rms_norm_eps)
            self.markov_head = nn.Module()
            self.markov_head.embed = nn.Embedding(c.vocab_size, r)
            self.markov_head.head = Linear(r, c.vocab_size, bias=False)
            self.confidence_head = nn.Module()
            self.confidence_head.proj = Linear(H + r, 1, bias=False)
            if not c.hc_shifted:
                self.hc_head = HyperHead(c.hc_mult, H, c.rms_norm_eps, c.hc_eps)

    def forward_block(self, R: torch.Tensor, prev_pre: torch.Tensor, positions: torch.Tensor,
                      main_slots: torch.Tensor, block_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The block rows' trunk through this draft block (attention as SparseLatentAttention.forward_block)."""
        def attention(u: torch.Tensor) -> torch.Tensor:
            return self.attn.forward_block(self.attn_norm(u), positions, main_slots, block_slots)

        R, prev_pre = self._sublayer(R, prev_pre, self.hc_attn, attention, None)
        return self._sublayer(R, prev_pre, self.hc_ffn, lambda u: self.ffn(self.ffn_norm(u), None), None)


class DeepseekV41ForCausalLM(nn.Module):
    # CUDA graphs (worker/cuda_graph.py): the layers gather their own slot lists (no attention backend metadata),
    # and a decode's work is sized by the context (every compressed entry a row may see), so graphs are captured
    # per context bucket.
    reads_attention_metadata = False
    decode_work_grows_with_context = True

    @staticmethod
    def read_config(cfg: dict[str, Any]) -> DeepseekV41Config:
        return DeepseekV41Config.from_hf_dict(cfg)

    def __init__(self, cfg: dict[str, Any], max_position: int) -> None:
        super().__init__()
        c = self.spec = self.read_config(cfg)
        self.config = cfg
        H, V = c.hidden_size, c.vocab_size
        ropes: dict[tuple, InterleavedRope] = {}

        def rope(layer: int | None) -> InterleavedRope:
            base = c.rope_theta if layer is None else c.layer_rope_theta(layer)
            y = None if layer is None else c.layer_yarn(layer)
            yarn = None if y is None else Yarn(y.original_max_position_embeddings, y.factor, y.beta_fast,
                                               y.beta_slow)
            key = (base, yarn)
            if key not in ropes:
                ropes[key] = InterleavedRope(c.qk_rope_head_dim, max(max_position, 1), base, yarn)
            return ropes[key]

        self.embed = Embedding(V, H)
        primes = engram_table_primes(c) if c.engram_enabled else {}
        self.layers = nn.ModuleList(DeepseekV41Block(c, l, rope(l), c.n_routed_experts, c.num_experts_per_tok,
                                                     primes.get(l)) for l in range(c.num_hidden_layers))
        self.ropes = nn.ModuleList(ropes.values())             # (their buffers move with the model)
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.tie_word_embeddings = c.tie_word_embeddings
        self.head = None if c.tie_word_embeddings else Linear(H, V, bias=False)
        self.hc_head = None if c.hc_shifted else HyperHead(c.hc_mult, H, c.rms_norm_eps, c.hc_eps)
        self.mtp = nn.ModuleList(DraftBlock(c, i, rope(None)) for i in range(c.num_nextn_predict_layers))
        for block in self.layers:                              # sharing: bind each layer to its sources' states
            roles = block.attn.roles
            block.attn.bind_sources(self.layers[roles.kv_source].attn if roles.ratio else None,
                                    self.layers[roles.index_k_source].attn if roles.is_index_source else None)
        L, n = c.num_hidden_layers, c.n_prefill_layer
        targets = c.dspark_target_layer_ids if c.num_nextn_predict_layers else ()
        self.yoco = yoco_from_env(window=c.sliding_window, has_consumer_half=n < L,
                                  consumer_engram=any(l >= n for l in c.engram_layer_ids),
                                  draft_targets_split=len({t >= n for t in targets}) > 1)
        # §8: YOCO skips (compact) or changes (mask) consumer-half rows of the prompt, so their logits are not the
        # prompt's: the engine refuses prompt logprobs with this reason.
        self.prompt_logprobs_unavailable = (f"YOCO: DEEPSERVE_YOCO_PREFILL_TRUNCATION_MODE={self.yoco.mode}"
                                            if self.yoco.active else None)
        self.dspark_targets: tuple[int, ...] = ()            # set by enable_dspark: the layers f_t reads
        self.token_ids = PagedState("token_ids", 1, 0, torch.int64) if c.engram_enabled else None
        if c.engram_enabled:
            # token id -> compressed id (§2.9): identity unless a compressed tokenizer is in use (set at load).
            self.register_buffer("engram_vocab", torch.arange(V), persistent=False)
            self.engram_pad = c.engram_pad_token_id

    # --- what the model runner sizes and binds ------------------------------------------------------------------
    def attention_layers(self) -> list[PagedState]:
        states = [p for block in self.layers for p in block.attn.paged_states()]
        drafts = [block.attn.swa for block in self.mtp] if self.dspark_targets else []     # the main cache
        return states + drafts + ([self.token_ids] if self.token_ids is not None else [])

    @property
    def prompt_window_keep(self) -> int | None:
        """YOCO (§8): in a prompt step the consumer layers compute (compact) or see (mask) only each sequence's last
        KEEP tokens, so only those positions' window states are whole; None: all are."""
        return self.yoco.keep if self.yoco.active else None

    def window_reach(self) -> int:
        """How many positions before its own a row reads per-position (window-pool) state at: the sliding window's
        W - 1, a compressor's span - 1 (the entry completed at a row pools the span's earlier tokens), the n-gram
        history's M - 1. The block manager gives a sequence's window blocks back once they lie further behind."""
        c = self.spec
        reach = c.sliding_window - 1
        for block in self.layers:
            for comp in (getattr(block.attn, "compressor", None), getattr(getattr(block.attn, "indexer", None),
                                                                          "compressor", None)):
                if comp is not None:
                    reach = max(reach, comp.span - 1)
        if self.token_ids is not None:
            reach = max(reach, c.engram_max_ngram_size - 1)
        return reach

    def enable_dspark(self) -> None:
        """Speculative decoding with the DSpark draft blocks (before the runner sizes the caches): their SWA states
        are allocated and every forward writes the main-cache keys into them."""
        c = self.spec
        if c.is_v4 or not c.num_nextn_predict_layers:
            raise ValueError("speculative_config method 'dspark' needs a DeepSeek-V4.1 model with draft layers; "
                             f"this config has num_nextn_predict_layers={c.num_nextn_predict_layers}")
        if c.dspark_noise_token_id is None:
            raise ValueError("speculative_config method 'dspark' needs dspark_noise_token_id in the model's config "
                             "(the block's filler token, §2.10)")
        if self.yoco.active:
            # Reading: the main cache needs every row's target-layer trunk; YOCO skips or alters consumer rows.
            raise ValueError("speculative_config method 'dspark' needs YOCO prefill truncation off "
                             f"(DEEPSERVE_YOCO_PREFILL_TRUNCATION_MODE={self.yoco.mode})")
        self.dspark_targets = tuple(c.dspark_target_layer_ids)

    def moe_layers(self) -> list[FusedMoE]:
        return [block.ffn for block in self.layers]

    # --- forward ------------------------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states (after the final norm) of the rows in `batch.logits_indices`."""
        c = self.spec
        step = ModelStep(batch, sequence_layouts(batch), c.sliding_window, self.yoco)
        x0 = self.embed(batch.input_ids)
        T = x0.shape[0]
        R = x0[:, None, :].expand(T, c.hc_mult, c.hidden_size).contiguous()
        prev_pre = first_pre(T, c.hc_mult, x0.device)
        ngrams = self._ngrams(step) if self.token_ids is not None else None
        features: dict[int, torch.Tensor] = {}
        for block in self.layers:
            if block.layer_id in self.dspark_targets:
                # Reading: "the trunk entering target layer τ" is taken before the layer's Engram.
                features[block.layer_id] = R.float().mean(1)
            R, prev_pre = block(R, prev_pre, step, ngrams)
        if features:
            self._write_main_keys(torch.cat([features[t] for t in self.dspark_targets], -1), batch)
        if step.kept_rows is not None:
            idx = self._kept_index(step, batch.logits_indices)
            R, prev_pre = R[idx], prev_pre[idx]
        else:       # a decode step's rows as they are (every row samples: no gather launch)
            R, prev_pre = batch.logits_rows(R), batch.logits_rows(prev_pre)
        h = combine_streams(R, prev_pre) if c.hc_shifted else self.hc_head(R)
        return self.norm(h)

    def _write_main_keys(self, f: torch.Tensor, batch: ForwardBatch) -> None:
        """§2.10's main cache: hm = main_norm(main_proj(f)); each draft layer's keys of every row at its slot
        (rows past a rejected draft are overwritten when their positions come again)."""
        first = self.mtp[0]
        hm = first.main_norm(first.main_proj(f.to(first.main_proj.weight.dtype)))
        for block in self.mtp:
            block.attn.write_main_keys(hm, batch.positions, batch.window_slots)

    def draft_hidden(self, block_ids: torch.Tensor, positions: torch.Tensor, main_slots: torch.Tensor,
                     block_slots: torch.Tensor) -> torch.Tensor:
        """hb [T, H] (before the post norm) of draft block rows: their own mHC trunk from the embedding (one-hot first
        pre, as the backbone), every draft block, then the shifted mix or the last block's HC head."""
        c = self.spec
        x0 = self.embed(block_ids)
        T = x0.shape[0]
        R = x0[:, None, :].expand(T, c.hc_mult, c.hidden_size).contiguous()
        prev_pre = first_pre(T, c.hc_mult, x0.device)
        for block in self.mtp:
            R, prev_pre = block.forward_block(R, prev_pre, positions, main_slots, block_slots)
        return combine_streams(R, prev_pre) if c.hc_shifted else self.mtp[-1].hc_head(R)

    def draft_base_logits(self, hb: torch.Tensor) -> torch.Tensor:
        """RMSNorm_post(hb) @ LMHead^T (fp32); the LM head is the backbone's."""
        return self.compute_logits(self.mtp[-1].norm(hb))

    def draft_step(self, hb: torch.Tensor, base: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft position of some rows: (logits = base + markov_head(markov_embed[prev]) fp32, the confidence
        head's logit w_c · [hb; markov_embed[prev]] fp32, before the temperature, clamp and sigmoid)."""
        last = self.mtp[-1]
        e = last.markov_head.embed(prev)
        logits = base + last.markov_head.head(e).float()
        conf = last.confidence_head.proj(torch.cat((hb, e.to(hb.dtype)), dim=-1)).float()[:, 0]
        return logits, conf

    @staticmethod
    def _kept_index(step: ModelStep, idx: torch.Tensor) -> torch.Tensor:
        """Batch rows -> their index among the kept rows (YOCO compact); every row that needs logits must be kept
        (the sampled last row always is; prompt logprobs are refused under YOCO)."""
        where = torch.full((step.batch.num_tokens,), -1, dtype=torch.long, device=idx.device)
        where[step.kept_rows] = torch.arange(step.kept_rows.numel(), device=idx.device)
        mapped = where[idx]
        if bool((mapped < 0).any()):
            raise ValueError("YOCO compact prefill dropped a row whose logits were asked for (prompt logprobs "
                             "are not available under YOCO)")
        return mapped

    def _ngrams(self, step: ModelStep) -> torch.Tensor:
        """[T, M] compressed ids of positions p, p-1, ..., p-M+1 of each row (before 0: the compressed pad)."""
        batch, M = step.batch, self.spec.engram_max_ngram_size
        self.token_ids.write(batch.window_slots, batch.input_ids[:, None])
        pad = self.engram_vocab[self.engram_pad]
        history = batch.positions[:, None] - torch.arange(M, device=batch.positions.device)[None, :]
        ids = self.token_ids.read(step.full_rows.token_slots(history).flatten()).view(history.shape)
        out = torch.where(history >= 0, self.engram_vocab[ids], pad)
        return out

    def head_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The head's output in the activations' dtype, into `out` if given (what a CUDA graph keeps; models/base.py
        says why)."""
        weight = self.embed.weight if self.head is None else self.head.weight
        return linear(hidden, weight, out=out)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head_logits(hidden).float()

    # --- loading ------------------------------------------------------------------------------------------------
    def checkpoint_targets(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint name -> shape of every tensor this model reads (the released names, §2.14 / §16.3)."""
        from deepserve.loader.deepseek_v41_weights import Target
        targets: dict[str, Target] = {}
        for name, p in self.named_parameters():
            for ck_name, shape in _checkpoint_names(name, p, with_bias_vl=not self.spec.is_v4):
                targets[ck_name] = Target(shape)
        for name, buf in self.named_buffers():
            if name.endswith("gate.tid2eid"):          # the hash layers' routing table (an integer buffer)
                targets[name] = Target(tuple(buf.shape), buf.dtype)
        return targets

    def load_checkpoint(self, model_dir: str) -> set[str]:
        """Validate the checkpoint against checkpoint_targets (all of it, from the headers), then fill every
        parameter, dequantized. Returns the engine names filled."""
        from deepserve.loader.deepseek_v41_weights import load_weights
        if self.token_ids is not None and self.spec.engram_compressed_vocab_size:
            self.set_engram_vocab(compressed_vocab_from_tokenizer(model_dir, self.spec.vocab_size))
        return self.load_weights(load_weights(model_dir, self.checkpoint_targets()))

    def set_engram_vocab(self, compressed_ids: list[int]) -> None:
        """Token id -> compressed id (§2.9), e.g. from the model's tokenizer.json."""
        ids = torch.as_tensor(compressed_ids, dtype=torch.long, device=self.engram_vocab.device)
        vc = engram_compressed_vocab_size(self.spec)
        if ids.shape != self.engram_vocab.shape or int(ids.min()) < 0 or int(ids.max()) >= vc:
            raise ValueError(f"engram vocab: need {self.spec.vocab_size} ids in [0, {vc}), got {tuple(ids.shape)}")
        self.engram_vocab.copy_(ids)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        params.update((n, b) for n, b in self.named_buffers() if n.endswith("gate.tid2eid"))
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            moe = re.match(r"((?:layers|mtp)\.\d+\.ffn)\.(.+)", name)
            if moe:
                filled = self._load_moe(moe.group(1), moe.group(2), tensor)
                if filled:
                    loaded.add(filled)
                continue
            engine = _engine_name(name)
            if engine not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            copy_checked(params[engine], tensor, name)
            loaded.add(engine)
        for block in self.layers:
            if block.hash_routed:
                block.ffn.gate.check_table()
        return loaded

    def _load_moe(self, prefix: str, rest: str, tensor: torch.Tensor) -> str | None:
        ffn = self.get_submodule(prefix)
        if rest == "gate.bias_vl":
            return None                                         # image tokens only: not on the text path
        rest = {"gate.bias": "gate.e_score_correction_bias"}.get(rest, rest)
        shared = re.match(r"shared_experts\.w([123])\.weight", rest)
        if shared:
            rest = "shared_experts." + {"1": "gate_proj", "3": "up_proj", "2": "down_proj"}[shared.group(1)] + \
                ".weight"
        if rest == "gate.tid2eid":
            copy_checked(ffn.gate.tid2eid, tensor, f"{prefix}.{rest}")
            return None                                         # a buffer: not in the parameter count
        filled = ffn.load_weight(rest, tensor)
        return None if filled is None else f"{prefix}.{filled}"


def compressed_vocab_from_tokenizer(model_dir: str, vocab_size: int) -> list[int]:
    """§2.9's compressed vocabulary from `tokenizer.json` in the model directory (each id decoded alone)."""
    import os

    from tokenizers import Tokenizer

    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"engram_compressed_vocab_size is set, so Engram needs {path} (§2.9)")
    tok = Tokenizer.from_file(path)
    decoded = [tok.decode([i], skip_special_tokens=False) for i in range(vocab_size)]
    raw = [tok.id_to_token(i) or "" for i in range(vocab_size)]
    return engram_compressed_ids(decoded, raw)


_HC = re.compile(r"(^|\.)hc_(attn|ffn|head)_(base|fn|scale)$")


def _engine_name(name: str) -> str:
    """A non-MoE checkpoint name -> the engine's (hc_attn_fn -> hc_attn.fn; the rest is the same)."""
    return _HC.sub(lambda m: f"{m.group(1)}hc_{m.group(2)}.{m.group(3)}", name)


def _checkpoint_names(name: str, p: torch.Tensor, with_bias_vl: bool) -> list[tuple[str, tuple]]:
    """The checkpoint tensors an engine parameter is made of (experts and the shared expert are split per
    projection; a V4.1 gate has bias_vl beside its bias)."""
    hc = re.match(r"(.*?)(^|\.)hc_(attn|ffn|head)\.(base|fn|scale)$", name)
    if hc:
        return [(f"{hc.group(1)}{hc.group(2)}hc_{hc.group(3)}_{hc.group(4)}", tuple(p.shape))]
    moe = re.match(r"((?:layers|mtp)\.\d+\.ffn)\.(.+)$", name)
    if not moe:
        return [(name, tuple(p.shape))]
    prefix, rest = moe.groups()
    if rest == "w13":
        E, two_i, H = p.shape
        return [(f"{prefix}.experts.{e}.w{w}.weight", (two_i // 2, H)) for e in range(E) for w in (1, 3)]
    if rest == "w2":
        E, H, inter = p.shape
        return [(f"{prefix}.experts.{e}.w2.weight", (H, inter)) for e in range(E)]
    if rest == "gate.e_score_correction_bias":
        return [(f"{prefix}.gate.bias", tuple(p.shape))] + \
            ([(f"{prefix}.gate.bias_vl", tuple(p.shape))] if with_bias_vl else [])
    if rest == "shared_experts.gate_up_proj.weight":
        two_i, H = p.shape
        return [(f"{prefix}.shared_experts.w1.weight", (two_i // 2, H)),
                (f"{prefix}.shared_experts.w3.weight", (two_i // 2, H))]
    if rest == "shared_experts.down_proj.weight":
        return [(f"{prefix}.shared_experts.w2.weight", tuple(p.shape))]
    return [(name, tuple(p.shape))]


class DeepseekV4ForCausalLM(DeepseekV41ForCausalLM):
    """DeepSeek-V4 (`model_type` "deepseek_v4"), HF transformers' reading (docs/deepseek_v4.md): the same blocks with
    V4's fields set in the config (CSA / HCA compressors, the indexer's own key compressor, the per-head q norm,
    the HC head, hash-routed first layers); no sharing, YOCO, Engram or draft layers."""

    @staticmethod
    def read_config(cfg: dict[str, Any]) -> DeepseekV41Config:
        return deepseek_v4_config(cfg)
