"""DeepSeek-V4.1-Flash reference forward, straight from the spec (/work/shared/reference/deepinfer.md §2, §16).

One sequence, the whole context at once: no paging, no KV cache, no batching, no YOCO truncation (§8 "off"),
no FP8/FP4 emulation (§2.13: needed only for bit-level parity with real checkpoints). This file is the oracle
the engine's paged, batched V4.1 model is tested against, so it favours being obviously right over being fast.

    x0 = embed[ids]; R = x0 in m streams                                          §2.3, §2.4
    per layer l:  [Engram(R)]                                                     §2.9
                  R = HC(attn):  u = pre·R -> attn_norm -> Attention -> post/Sinkhorn mix   §2.4, §2.5-§2.7
                  R = HC(ffn):   u = pre·R -> ffn_norm  -> MoE       -> post/Sinkhorn mix   §2.4, §2.8
    h = shifted ? pre_last·R : HCHead(R);  logits = norm(h) @ head^T  (fp32)      §2.3, §2.4

Parameters carry the HF names of §2.14 / §3 / §16.3 (`layers.3.attn.compressor.wkv.weight`, `layers.0.hc_attn_fn`,
`mtp.0.main_proj.weight`, ...), so an unquantized (or dequantized) checkpoint state dict loads with
`load_state_dict`. Layers that share (§2.2) hold no weights for what they share. DSpark draft blocks (`mtp.*`)
are built here; their forward (the drafter's oracle) is reference/dspark.py.

Computation: matmuls in the parameter dtype; norms, mHC, attention scores/softmax, router and logits in fp32
(§2.12); the trunk is stored in the parameter dtype (bf16 in the released model).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deepserve.models.deepseek_v41_config import DeepseekV41Config
from deepserve.models.engram_hashing import (engram_compressed_vocab_size, engram_multipliers,
                                             engram_table_primes)

# ============================================================================ basic modules (§2.12)


class Linear(nn.Module):
    """`<module>.weight` [out, in], no bias (§16.3). Uninitialised: load a checkpoint or init_tiny_weights."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, dim, dtype=dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """§2.12: y = x * rsqrt(mean(x^2) + eps) * w, in fp32 (returned fp32)."""
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps).to(self.weight.dtype)


# ============================================================================ RoPE (§2.12, §16.12)


def rope_inv_freq(config: DeepseekV41Config, layer: int | None) -> torch.Tensor:
    """float64 [R/2]: base^(-2i/R); YaRN when rope_scaling is present, in compressed layers only (§16.12).
    layer=None: a draft layer (base rope_theta, no YaRN; §2.2)."""
    R = config.qk_rope_head_dim
    base = config.rope_theta if layer is None else config.layer_rope_theta(layer)
    yarn = None if layer is None else config.layer_yarn(layer)
    inv_freq = base ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
    if yarn is None:
        return inv_freq

    def correction_dim(beta: float) -> float:
        return R * math.log(yarn.original_max_position_embeddings / (beta * 2 * math.pi)) / (2 * math.log(base))

    # §16.12: floor/ceil, both clamped to [0, R-1] literally; high += 0.001 if equal; ramp over i in [0, R/2).
    low = min(max(math.floor(correction_dim(yarn.beta_fast)), 0), R - 1)
    high = min(max(math.ceil(correction_dim(yarn.beta_slow)), 0), R - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(R // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / yarn.factor * ramp + inv_freq * (1 - ramp)     # interp·ramp + extrap·(1 - ramp)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
               inverse: bool = False) -> torch.Tensor:
    """Interleaved pairs (2i, 2i+1) of the trailing R = 2·len(inv_freq) dims of x [T, ..., D] (§2.12); angles
    in float64, cos/sin in float32 (§16.12). inverse=True rotates by -angle (the output de-RoPE of §2.5)."""
    R = 2 * inv_freq.numel()
    angles = positions.to(torch.float64)[:, None] * inv_freq.to(positions.device)[None, :]
    cos, sin = angles.cos().float(), angles.sin().float()
    if inverse:
        sin = -sin
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (R // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    x0, x1 = x[..., -R:].float().unflatten(-1, (R // 2, 2)).unbind(-1)
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-R], rotated.to(x.dtype)), dim=-1)


# ============================================================================ mHC (§2.4, §16.5)


def sinkhorn(logits: torch.Tensor, eps: float, iters: int) -> torch.Tensor:
    """§2.4 step 4 on [..., m, m]: softmax over the last dim + eps, column-normalise; then iters-1 times
    row-normalise, column-normalise (each with + eps in the denominator)."""
    C = logits.softmax(-1) + eps
    C = C / (C.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        C = C / (C.sum(-1, keepdim=True) + eps)
        C = C / (C.sum(-2, keepdim=True) + eps)
    return C


def hc_mix(R: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           config: DeepseekV41Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """§2.4 steps 1-4 from the trunk R [T, m, H]: (pre [T, m], post [T, m], C [T, m, m] doubly stochastic)."""
    T, m, H = R.shape
    z = R.reshape(T, m * H).float()                                   # stream-major (§16.5)
    mix = (z @ fn.float().T) * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
    s = scale.float()
    mix = mix * torch.cat((s[0].expand(m), s[1].expand(m), s[2].expand(m * m))) + base.float()
    pre = torch.sigmoid(mix[:, :m]) + config.hc_eps
    post = config.hc_post_mult_value * torch.sigmoid(mix[:, m:2 * m])
    C = sinkhorn(mix[:, 2 * m:].view(T, m, m), config.hc_eps, config.hc_sinkhorn_iters)   # C[i,j] = mix[2m+i*m+j]
    return pre, post, C


def hc_combine(R: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_i w_i · R_i: [T, m, H] x [T, m] -> [T, H] (fp32 accumulate, stored in the trunk dtype)."""
    return torch.einsum("tm,tmh->th", weights.float(), R.float()).to(R.dtype)


def hc_post(R: torch.Tensor, y: torch.Tensor, post: torch.Tensor, C: torch.Tensor) -> torch.Tensor:
    """§2.4 step 6: R'_j = post_j · y + Σ_i C[i, j] · R_i (note the transpose)."""
    out = post[:, :, None] * y.float()[:, None, :] + torch.einsum("tij,tih->tjh", C, R.float())
    return out.to(R.dtype)


def hc_head(R: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            config: DeepseekV41Config) -> torch.Tensor:
    """Non-shifted HC head (§2.4, §16.5): w = sigmoid(mix·scale + base) + hc_eps with rms_norm_eps in the
    rsqrt; h = Σ_i w_i R_i."""
    T, m, H = R.shape
    z = R.reshape(T, m * H).float()
    mix = (z @ fn.float().T) * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)
    w = torch.sigmoid(mix * scale.float() + base.float()) + config.hc_eps
    return hc_combine(R, w)


def hc_params(owner: nn.Module, prefix: str, m: int, H: int) -> None:
    """`{prefix}_base` [m(m+2)], `{prefix}_fn` [m(m+2), m·H], `{prefix}_scale` [3], all fp32 (§2.14)."""
    n = m * (m + 2)
    setattr(owner, f"{prefix}_base", nn.Parameter(torch.empty(n, dtype=torch.float32)))
    setattr(owner, f"{prefix}_fn", nn.Parameter(torch.empty(n, m * H, dtype=torch.float32)))
    setattr(owner, f"{prefix}_scale", nn.Parameter(torch.empty(3, dtype=torch.float32)))


# ============================================================================ Engram module (§2.9)


class Engram(nn.Module):
    """Hashed n-gram memory added to the trunk before the attention pre-mix of its layer."""

    def __init__(self, config: DeepseekV41Config, layer_id: int, primes: list[list[int]], dtype: torch.dtype):
        super().__init__()
        self.config, self.layer_id = config, layer_id
        m, H, M, nh, dh = (config.hc_mult, config.hidden_size, config.engram_max_ngram_size, config.engram_n_heads,
                           config.engram_head_dim)
        self.multipliers = engram_multipliers(config, layer_id)
        self.primes = [p for heads in primes for p in heads]          # (n, h) order, n outer
        self.offsets = [sum(self.primes[:i]) for i in range(len(self.primes))]   # exclusive prefix sums
        # Reading: the checkpoint table has Σ primes rows; §2.14's "(padded)" is the runtime row sharding of
        # §2.9/§3 (pad rows zero). Padded checkpoint tables load too: the extra rows are dropped on load.
        self.embed = Embedding(sum(self.primes), dh, dtype)
        self.wkv = Linear((M - 1) * nh * dh, (m + 1) * H, dtype)
        self.q_weight = nn.Parameter(torch.empty(m, H, dtype=dtype))
        self.k_weight = nn.Parameter(torch.empty(m, H, dtype=dtype))
        self.register_load_state_dict_pre_hook(self._drop_table_padding)

    def _drop_table_padding(self, module, state_dict, prefix, *args) -> None:
        name = prefix + "embed.weight"
        rows = self.embed.weight.shape[0]
        if name in state_dict and state_dict[name].shape[0] > rows:
            state_dict[name] = state_dict[name][:rows]

    def hash_indices(self, cids: torch.Tensor, pad: int) -> torch.Tensor:
        """[T] compressed ids -> [T, (M-1)·n_heads] table rows. Row p's n-gram is [c(p), c(p-1), ...],
        positions < 0 -> the compressed pad; hash = XOR_r (tok_r · u_r) (int64), row = hash mod P + offset."""
        T, M, nh = cids.shape[0], self.config.engram_max_ngram_size, self.config.engram_n_heads
        shifted = [torch.cat((cids.new_full((min(k, T),), pad), cids[:max(T - k, 0)])) for k in range(M)]
        rows = []
        for n in range(2, M + 1):
            mix = shifted[0] * self.multipliers[0]
            for r in range(1, n):
                mix = torch.bitwise_xor(mix, shifted[r] * self.multipliers[r])
            for h in range(nh):
                i = (n - 2) * nh + h
                rows.append(torch.remainder(mix, self.primes[i]) + self.offsets[i])   # Python-style mod (§2.9)
        return torch.stack(rows, dim=1)

    def forward(self, R: torch.Tensor, cids: torch.Tensor, pad: int) -> torch.Tensor:
        T, m, H = R.shape
        e = self.embed.weight[self.hash_indices(cids, pad)].flatten(1)      # [T, (M-1)·nh·dh]
        kv = self.wkv(e).view(T, m + 1, H)
        # keys = first m rows, value = last row (§2.9 "[order inferred]"; kept as the spec infers it).
        k, v = kv[:, :m], kv[:, m]
        eps = self.config.rms_norm_eps
        # Reading: the gate's RMSNorms use rms_norm_eps.
        d = (rms_norm(R, None, eps) * self.q_weight.float() * rms_norm(k, None, eps) * self.k_weight.float()
             ).sum(-1) / math.sqrt(H)                                                    # [T, m]
        g = torch.sigmoid(torch.sign(d) * d.abs().clamp(min=1e-6).sqrt())
        return (R.float() + g[..., None] * v.float()[:, None, :]).to(R.dtype)


# ============================================================================ compressed KV, indexer (§2.6)


class Compressor(nn.Module):
    """KV-source compressed layers only: `wkv` [D, H], `wgate` [D, H] (ratio 2), `norm` [D]."""

    def __init__(self, config: DeepseekV41Config, ratio: int, dtype: torch.dtype) -> None:
        super().__init__()
        D, H = config.head_dim, config.hidden_size
        self.ratio = ratio
        self.wkv = Linear(H, D, dtype)
        if ratio == 2:
            self.wgate = Linear(H, D, dtype)
        self.norm = RMSNorm(D, config.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> pre-RoPE compressed entries [T // ratio, D] (complete blocks only, §16.7)."""
        lat = self.wkv(x).float()
        if self.ratio == 1:
            c = lat                                                          # C1: c_t = a_t @ A^T
        else:
            n = x.shape[0] // self.ratio * self.ratio
            score = self.wgate(x[:n]).float().view(-1, self.ratio, lat.shape[-1])
            # C2: block j = tokens {2j, 2j+1}; softmax over the block's tokens, per channel.
            c = (score.softmax(dim=1) * lat[:n].view(-1, self.ratio, lat.shape[-1])).sum(1)
        return self.norm(c.to(x.dtype))                                      # pre_rope = RMSNorm(norm)(c)


class Indexer(nn.Module):
    """Index sources: `wq_b` [Hi·Di, Lq], `weights_proj` [Hi, H]; index-K sources: `wk` [Di, D], `k_norm` [Di]."""

    def __init__(self, config: DeepseekV41Config, query: bool, keys: bool, dtype: torch.dtype) -> None:
        super().__init__()
        Hi, Di = config.index_n_heads, config.index_head_dim
        if query:
            self.wq_b = Linear(config.q_lora_rank, Hi * Di, dtype)
            self.weights_proj = Linear(config.hidden_size, Hi, dtype)
        if keys:
            self.wk = Linear(config.head_dim, Di, dtype)
            self.k_norm = RMSNorm(Di, config.rms_norm_eps, dtype)

    def keys(self, pre_rope: torch.Tensor, ratio: int, inv_freq: torch.Tensor) -> torch.Tensor:
        """ki = RMSNorm(k_norm)(pre_rope @ wk^T), RoPE at position j·ratio (§2.6, §16.8): [Nc, Di]."""
        ki = self.k_norm(self.wk(pre_rope))
        return apply_rope(ki, torch.arange(ki.shape[0], device=ki.device) * ratio, inv_freq)

    def logits(self, qn: torch.Tensor, a: torch.Tensor, ki: torch.Tensor, positions: torch.Tensor,
               inv_freq: torch.Tensor) -> torch.Tensor:
        """I(t, j) = Σ_h w[t,h] · relu(qi[t,h] · ki[j]) with qi from the q_norm output (§16.8), w = a @
        weights_proj^T; no global scale. [T, Nc] fp32."""
        T = qn.shape[0]
        qi = apply_rope(self.wq_b(qn).view(T, -1, ki.shape[-1]), positions, inv_freq)
        w = self.weights_proj(a).float()
        return torch.einsum("th,thj->tj", w, torch.einsum("thd,jd->thj", qi.float(), ki.float()).relu())


def select_topk(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the k largest allowed scores; exact ties -> lower index (stable order, §16.9); fewer than k
    allowed -> all of them. Returns (indices [T, k] padded with -1, mask [T, N])."""
    T, N = scores.shape
    order = torch.sort(scores.masked_fill(~allowed, float("-inf")), dim=-1, descending=True, stable=True).indices
    order = F.pad(order[:, :k], (0, max(0, k - N)), value=-1)
    count = allowed.sum(-1, keepdim=True).clamp(max=k)
    indices = torch.where(torch.arange(k, device=scores.device)[None, :] < count, order, -1)
    mask = torch.zeros(T, N + 1, dtype=torch.bool, device=scores.device)
    mask.scatter_(1, torch.where(indices < 0, N, indices), True)
    return indices, mask[:, :N]


def candidate_block_mask(logits: torch.Tensor, visible: torch.Tensor, block_size: int,
                         topk_blocks: int) -> torch.Tensor:
    """§16.10: aligned blocks [b·bs, (b+1)·bs) of compressed entries scored by the max over their visible entries;
    the top `topk_blocks` blocks with a visible entry are kept. Returns the entries of kept blocks [T, N]."""
    T, N = logits.shape
    n_blocks = -(-N // block_size)
    pad = n_blocks * block_size - N
    scores = F.pad(logits.masked_fill(~visible, float("-inf")), (0, pad), value=float("-inf"))
    block_scores = scores.view(T, n_blocks, block_size).amax(-1)
    block_visible = F.pad(visible, (0, pad), value=False).view(T, n_blocks, block_size).any(-1)
    _, kept = select_topk(block_scores, block_visible, topk_blocks)
    return kept.repeat_interleave(block_size, dim=1)[:, :N]


# ============================================================================ attention (§2.5)


class ForwardState:
    """Cross-layer values of one forward (§2.7): compressed KV / pre-RoPE KV per KV source, index keys per
    index-K source, top-k masks per index source, the candidate blocks, the YOCO shared hidden."""

    def __init__(self, trace: dict | None) -> None:
        self.compressed_kv: dict[int, torch.Tensor] = {}
        self.pre_rope_kv: dict[int, torch.Tensor] = {}
        self.index_k: dict[int, torch.Tensor] = {}
        self.selected: dict[int, torch.Tensor] = {}
        self.topk: dict[int, torch.Tensor] = {}
        self.candidates: torch.Tensor | None = None
        self.shared_hidden: torch.Tensor | None = None
        self.trace = trace

    def record(self, layer: int, **values: Any) -> None:
        if self.trace is not None:
            self.trace.setdefault("layers", {}).setdefault(layer, {}).update(values)


class Attention(nn.Module):
    """Single-KV-head latent attention (MQA over the D-dim latent), SWA on every layer, per-head sinks, and for
    compressed layers the compressed entries chosen by the indexer (sparse) or all visible ones (dense)."""

    def __init__(self, config: DeepseekV41Config, layer_id: int | None, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        H, nH, D, Lq, G, Lo = c.hidden_size, c.num_attention_heads, c.head_dim, c.q_lora_rank, c.o_groups, c.o_lora_rank
        self.config, self.layer_id = c, layer_id                 # layer_id None: a DSpark draft layer (SWA only)
        self.ratio = 0 if layer_id is None else c.compress_ratio(layer_id)
        self.wq_a = Linear(H, Lq, dtype)
        self.q_norm = RMSNorm(Lq, c.rms_norm_eps, dtype)
        self.wq_b = Linear(Lq, nH * D, dtype)
        self.wkv = Linear(H, D, dtype)
        self.kv_norm = RMSNorm(D, c.rms_norm_eps, dtype)
        self.wo_a = Linear(nH // G * D, G * Lo, dtype)            # grouped Wv, stored [G·Lo, (nH/G)·D]
        self.wo_b = Linear(G * Lo, H, dtype)
        self.attn_sink = nn.Parameter(torch.empty(nH, dtype=torch.float32))
        if layer_id is not None and c.is_kv_source(layer_id):
            self.compressor = Compressor(c, self.ratio, dtype)
        if layer_id is not None and (c.is_index_source(layer_id) or c.is_index_k_source(layer_id)):
            self.indexer = Indexer(c, c.is_index_source(layer_id), c.is_index_k_source(layer_id), dtype)
        self.register_buffer("inv_freq", rope_inv_freq(c, layer_id), persistent=False)

    def forward(self, a: torch.Tensor, positions: torch.Tensor, state: ForwardState) -> torch.Tensor:
        c, T = self.config, a.shape[0]
        qn = self.q_norm(self.wq_a(a))                                            # [T, Lq]
        q = apply_rope(self.wq_b(qn).view(T, c.num_attention_heads, c.head_dim), positions, self.inv_freq)
        kv = apply_rope(self.kv_norm(self.wkv(a)), positions, self.inv_freq)       # SWA keys = values [T, D]
        # (a) SWA: keys at positions [p - W + 1, p] (§16.6).
        dist = positions[:, None] - positions[None, :]
        keys, masks = [kv], [(dist >= 0) & (dist < c.sliding_window)]
        if self.ratio > 0:                                                        # (b) compressed entries
            ckv, selected = self.compressed_entries(a, qn, positions, state)
            keys.append(ckv)
            masks.append(selected)
        o = sink_attention(q, torch.cat(keys), torch.cat(masks, dim=1), self.attn_sink, c.head_dim)
        if self.layer_id is not None:
            state.record(self.layer_id, attn_input=a, swa_kv=kv)
        # Output: undo RoPE at the query position (§2.5). # Reading of §16.6 "applies to the whole output": the
        # de-RoPE rotates the last R dims of the combined SWA + compressed output (not per key source).
        o = apply_rope(o.to(a.dtype), positions, self.inv_freq, inverse=True)
        return self.wo_b(self.grouped_wv(o))

    def grouped_wv(self, o: torch.Tensor) -> torch.Tensor:
        """[T, nH, D] -> [T, G·Lo]: group g = heads g·nH/G ... (g+1)·nH/G - 1 through Wv[g] (§2.5, §16.6)."""
        c, T = self.config, o.shape[0]
        wv = self.wo_a.weight.view(c.o_groups, c.o_lora_rank, -1)
        return torch.einsum("tgi,goi->tgo", o.reshape(T, c.o_groups, -1).to(wv.dtype), wv).reshape(T, -1)

    def compressed_entries(self, a: torch.Tensor, qn: torch.Tensor, positions: torch.Tensor,
                           state: ForwardState) -> tuple[torch.Tensor, torch.Tensor]:
        """(compressed KV this layer reads [Nc, D], which of them each query attends to [T, Nc]) (§2.6, §2.7)."""
        c, l, r = self.config, self.layer_id, self.ratio
        if c.is_kv_source(l):
            # §16.7: consumer-half KV sources compress shared_hidden (norm1 output of layer n_prefill_layer).
            x = state.shared_hidden if c.is_consumer(l) else a
            pre_rope = self.compressor(x)
            state.pre_rope_kv[l] = pre_rope
            entry_pos = torch.arange(pre_rope.shape[0], device=a.device) * r          # entry j at j·ratio
            state.compressed_kv[l] = apply_rope(pre_rope, entry_pos, self.inv_freq)
        ckv = state.compressed_kv[c.kv_map[l]]                                        # shared: the source's
        visible = torch.arange(ckv.shape[0], device=a.device)[None, :] < ((positions + 1) // r)[:, None]
        state.record(l, compressed_kv=ckv, visible=visible)
        if not c.is_sparse(l):
            state.record(l, selected=visible)
            return ckv, visible                                                       # dense: all visible
        if c.is_index_k_source(l):
            state.index_k[l] = self.indexer.keys(state.pre_rope_kv[c.kv_map[l]], r, self.inv_freq)
        if c.is_index_source(l):
            ki = state.index_k[c.index_k_map[l]]
            logits = self.indexer.logits(qn, a, ki, positions, self.inv_freq)
            allowed = visible
            if l in c.candidate_consumers:
                allowed = allowed & state.candidates
            state.topk[l], state.selected[l] = select_topk(logits, allowed, c.index_topk)
            if l == c.candidate_source_layer_id:                  # its own top-k above is unrestricted
                state.candidates = candidate_block_mask(logits, visible, c.candidate_block_size,
                                                        c.candidate_topk_blocks)
                state.record(l, candidates=state.candidates)
            state.record(l, index_k=ki, index_logits=logits)
        src = c.index_map[l]                                      # top-k reusers take the last source's
        state.record(l, topk=state.topk[src], selected=state.selected[src])
        return ckv, state.selected[src]


def sink_attention(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor,
                   head_dim: int) -> torch.Tensor:
    """One softmax over the visible keys plus a per-head sink logit that joins the denominator only (§2.5):
    p_j = exp(s_j) / (Σ_k exp(s_k) + exp(sink_h)), s = q·k / sqrt(D), o = Σ_j p_j v_j with v = k. fp32."""
    T, nH, _ = q.shape
    s = torch.einsum("thd,sd->ths", q.float(), kv.float()) / math.sqrt(head_dim)
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    s = torch.cat((s, sink.float().view(1, nH, 1).expand(T, nH, 1)), dim=-1)     # sink logit is not scaled
    p = s.softmax(-1)[..., :-1]
    return torch.einsum("ths,sd->thd", p, kv.float())


# ============================================================================ MoE (§2.8, §16.11)


class Expert(nn.Module):
    """SwiGLU `w1`, `w3` [I, H], `w2` [H, I] with the swiglu_limit clamp (routed and shared experts)."""

    def __init__(self, H: int, inter: int, limit: float | None, dtype: torch.dtype) -> None:
        super().__init__()
        self.limit = limit
        self.w1, self.w2, self.w3 = Linear(H, inter, dtype), Linear(inter, H, dtype), Linear(H, inter, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u = self.w1(x), self.w3(x)
        if self.limit:                                            # silu(min(W1x, L)) ⊙ clamp(W3x, -L, L)
            g, u = g.clamp(max=self.limit), u.clamp(-self.limit, self.limit)
        return self.w2(F.silu(g) * u)


class Gate(nn.Module):
    """`weight` [E, H], `bias` [E] fp32; `bias_vl` [E] fp32 (image tokens; unused on the text path).
    # Reading: every gate has bias_vl (§2.14 lists it), so a checkpoint without it needs strict=False."""

    def __init__(self, E: int, H: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(E, H, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(E, dtype=torch.float32))
        self.bias_vl = nn.Parameter(torch.empty(E, dtype=torch.float32))


def route(x: torch.Tensor, gate_weight: torch.Tensor, bias: torch.Tensor, top_k: int,
          routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """§2.8: s = sqrt(softplus(x @ Wgate^T)) in fp32 (torch's default threshold 20); experts chosen by s + bias
    (stable: lower id wins ties); weights s_e / Σ_sel s · routed_scaling_factor. Returns ([T, k] ids, weights)."""
    s = F.softplus(x.float() @ gate_weight.float().T).sqrt()
    experts = torch.sort(s + bias.float(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = s.gather(1, experts)
    return experts, w / w.sum(-1, keepdim=True) * routed_scaling_factor


class MoE(nn.Module):
    def __init__(self, config: DeepseekV41Config, n_experts: int, top_k: int, dtype: torch.dtype) -> None:
        super().__init__()
        c = config
        self.top_k, self.scale = top_k, c.routed_scaling_factor
        self.gate = Gate(n_experts, c.hidden_size, dtype)
        self.experts = nn.ModuleList(Expert(c.hidden_size, c.moe_intermediate_size, c.swiglu_limit, dtype)
                                     for _ in range(n_experts))
        if c.n_shared_experts:                                    # one SwiGLU of width I·n_shared
            self.shared_experts = Expert(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts,
                                         c.swiglu_limit, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = route(x, self.gate.weight, self.gate.bias, self.top_k, self.scale)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e in experts.unique().tolist():
            rows, slot = (experts == e).nonzero(as_tuple=True)
            y.index_add_(0, rows, weights[rows, slot, None] * self.experts[e](x[rows]).float())
        if hasattr(self, "shared_experts"):
            y = y + self.shared_experts(x).float()
        return y.to(x.dtype)


# ============================================================================ blocks and model (§2.3)


class Block(nn.Module):
    """One HC block: hc_attn_*, attn_norm, attn, hc_ffn_*, ffn_norm, ffn (+ engram in engram layers)."""

    def __init__(self, config: DeepseekV41Config, layer_id: int | None, n_experts: int, top_k: int,
                 dtype: torch.dtype, engram_primes: list[list[int]] | None = None) -> None:
        super().__init__()
        c = config
        self.config, self.layer_id = c, layer_id
        hc_params(self, "hc_attn", c.hc_mult, c.hidden_size)
        hc_params(self, "hc_ffn", c.hc_mult, c.hidden_size)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.attn = Attention(c, layer_id, dtype)
        self.ffn = MoE(c, n_experts, top_k, dtype)
        if engram_primes is not None:
            self.engram = Engram(c, layer_id, engram_primes, dtype)

    def forward(self, R: torch.Tensor, prev_pre: torch.Tensor, positions: torch.Tensor, state: ForwardState,
                engram_ids: torch.Tensor | None, engram_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
        c, l = self.config, self.layer_id
        state.record(l, block_trunk=R)            # the trunk entering the layer (DSpark's main cache reads it)
        if hasattr(self, "engram"):
            # §2.9: on the trunk, before the attention pre-mix. # Reading: the updated trunk is what the attention
            # sublayer sees everywhere (its mix parameters, its input and its residual mixing).
            R = self.engram(R, engram_ids, engram_pad)

        def attention(u: torch.Tensor) -> torch.Tensor:
            a = self.attn_norm(u)
            if l == c.n_prefill_layer:                           # §2.7: the YOCO shared hidden
                state.shared_hidden = a
                if state.trace is not None:
                    state.trace["shared_hidden"] = a
            return self.attn(a, positions, state)

        R, prev_pre = self.sublayer(R, prev_pre, "hc_attn", attention, state)
        R, prev_pre = self.sublayer(R, prev_pre, "hc_ffn", lambda u: self.ffn(self.ffn_norm(u)), state)
        return R, prev_pre

    def sublayer(self, R: torch.Tensor, prev_pre: torch.Tensor, hc: str, f,
                 state: ForwardState) -> tuple[torch.Tensor, torch.Tensor]:
        """§2.4 / §16.5: mix params from the trunk entering s; the input uses the previous sublayer's pre when
        shifted, its own otherwise; post and C are always its own. Returns (new trunk, this sublayer's pre)."""
        pre, post, C = hc_mix(R, getattr(self, f"{hc}_fn"), getattr(self, f"{hc}_base"),
                              getattr(self, f"{hc}_scale"), self.config)
        state.record(self.layer_id, **{f"{hc}_trunk": R})                    # the trunk entering sublayer s
        y = f(hc_combine(R, prev_pre if self.config.hc_shifted else pre))
        return hc_post(R, y, post, C), pre


class DraftBlock(Block):
    """DSpark draft block `mtp.{i}` (§2.10, §2.14): SWA-only attention with base RoPE, MoE with the dspark expert
    counts; block 0 owns main_proj / main_norm, the last owns norm, markov_head, confidence_head (+ the HC head
    when not shifted). Its draft forward (main cache, block drafting) is reference/dspark.py."""

    def __init__(self, config: DeepseekV41Config, index: int, dtype: torch.dtype) -> None:
        super().__init__(config, None, config.draft_n_routed_experts, config.draft_num_experts_per_tok, dtype)
        c, H, r = config, config.hidden_size, config.dspark_markov_rank
        if index == 0:
            self.main_proj = Linear(len(c.dspark_target_layer_ids) * H, H, dtype)
            self.main_norm = RMSNorm(H, c.rms_norm_eps, dtype)
        if index == c.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(H, c.rms_norm_eps, dtype)
            # Reading: §16.3's `<module>.weight` rule applies to these too: markov_head.embed.weight,
            # markov_head.head.weight, confidence_head.proj.weight, main_proj.weight, main_norm.weight.
            self.markov_head = nn.Module()
            self.markov_head.embed = Embedding(c.vocab_size, r, dtype)
            self.markov_head.head = Linear(r, c.vocab_size, dtype)
            self.confidence_head = nn.Module()
            self.confidence_head.proj = Linear(H + r, 1, dtype)
            # Reading: "HC head (non-shifted)" = the draft HC head exists only in the non-shifted variant.
            if not c.hc_shifted:
                add_hc_head(self, c)

    def forward(self, *args, **kwargs):
        raise NotImplementedError("a draft block runs through reference/dspark.py (§2.10)")


def add_hc_head(owner: nn.Module, c: DeepseekV41Config) -> None:
    """`hc_head_base` [m], `hc_head_fn` [m, m·H], `hc_head_scale` [1], fp32 (non-shifted mHC only)."""
    m = c.hc_mult
    owner.hc_head_base = nn.Parameter(torch.empty(m, dtype=torch.float32))
    owner.hc_head_fn = nn.Parameter(torch.empty(m, m * c.hidden_size, dtype=torch.float32))
    owner.hc_head_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))


class DeepseekV41Reference(nn.Module):
    """`forward(input_ids [T]) -> logits [T, V]` (fp32) for one sequence at positions 0..T-1."""

    def __init__(self, config: DeepseekV41Config, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        with torch.device(device or "cpu"):
            self._build(config, dtype)

    def _build(self, c: DeepseekV41Config, dtype: torch.dtype) -> None:
        if c.is_v4:
            raise ValueError("DeepseekV41Reference is V4.1's oracle; a DeepSeek-V4 config has other blocks "
                             "(its reference is HF transformers' DeepseekV4ForCausalLM)")
        self.config = c
        H, V = c.hidden_size, c.vocab_size
        self.embed = Embedding(V, H, dtype)
        primes = engram_table_primes(c) if c.engram_enabled else {}
        self.layers = nn.ModuleList(Block(c, l, c.n_routed_experts, c.num_experts_per_tok, dtype, primes.get(l))
                                    for l in range(c.num_hidden_layers))
        self.norm = RMSNorm(H, c.rms_norm_eps, dtype)
        if not c.tie_word_embeddings:                             # tied: logits use embed.weight, no head.weight
            self.head = Linear(H, V, dtype)
        if not c.hc_shifted:
            add_hc_head(self, c)
        if c.num_nextn_predict_layers:
            self.mtp = nn.ModuleList(DraftBlock(c, i, dtype) for i in range(c.num_nextn_predict_layers))
        if c.engram_enabled:
            # token id -> compressed id (§2.9). Identity unless a compressed tokenizer is in use.
            self.register_buffer("engram_vocab", torch.arange(V), persistent=False)
            self.engram_vocab_ready = not c.engram_compressed_vocab_size

    def set_engram_vocab(self, compressed_ids: Sequence[int] | torch.Tensor) -> None:
        """The compressed vocabulary of §2.9 (e.g. from engram_compressed_ids over the model's tokenizer)."""
        ids = torch.as_tensor(compressed_ids, dtype=torch.long, device=self.embed.weight.device)
        vc = engram_compressed_vocab_size(self.config)
        if ids.shape != (self.config.vocab_size,) or int(ids.min()) < 0 or int(ids.max()) >= vc:
            raise ValueError(f"engram vocab: need {self.config.vocab_size} ids in [0, {vc}), got shape "
                             f"{tuple(ids.shape)}")
        self.engram_vocab.copy_(ids)
        self.engram_vocab_ready = True

    def forward(self, input_ids: torch.Tensor, trace: dict | None = None) -> torch.Tensor:
        """input_ids LongTensor [T] -> logits float32 [T, V]. `trace`, when a dict, receives per-layer
        intermediates (trace["layers"][l]: block_trunk (entering the layer, before Engram), hc_attn_trunk /
        hc_ffn_trunk (entering each sublayer), attn_input, swa_kv, compressed_kv, visible, selected, topk, index_k,
        index_logits, candidates), trace["shared_hidden"] and trace["final_trunk"]."""
        c = self.config
        T, m = input_ids.shape[0], c.hc_mult
        positions = torch.arange(T, device=input_ids.device)
        state = ForwardState(trace)
        engram_ids, engram_pad = None, 0
        if c.engram_enabled:
            if not self.engram_vocab_ready:
                raise RuntimeError("engram_compressed_vocab_size is set: call set_engram_vocab() first (§2.9)")
            engram_ids = self.engram_vocab[input_ids]
            engram_pad = int(self.engram_vocab[c.engram_pad_token_id])       # the compressed pad
        x0 = self.embed.weight[input_ids]                                    # [T, H]
        R = x0[:, None, :].expand(T, m, c.hidden_size).contiguous()          # §2.4: replicated into m streams
        prev_pre = F.one_hot(torch.zeros(T, dtype=torch.long, device=x0.device), m).float()   # (1, 0, ..., 0)
        for block in self.layers:
            R, prev_pre = block(R, prev_pre, positions, state, engram_ids, engram_pad)
        if trace is not None:
            trace["final_trunk"] = R
        if c.hc_shifted:
            h = hc_combine(R, prev_pre)                                      # the last sublayer's pre
        else:
            h = hc_head(R, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c)
        head = self.embed.weight if c.tie_word_embeddings else self.head.weight
        return self.norm(h).float() @ head.float().T
