"""DSpark draft model reference (deepinfer.md §2.10), straight from the spec: the oracle of the engine's drafter.

One sequence, the whole context at once, no paging, no cache, no ring: the target reference forward
(reference/deepseek_v41.py) runs over the sequence's committed positions 0..p with a trace, and

    f_t  = concat_{τ in dspark_target_layer_ids} mean_i R^(τ)_i(t)      (the trunk entering layer τ, before Engram)
    hm   = main_norm(main_proj(f))                                       (block 0's)
    main keys of draft layer d at t:  RoPE_t(kv_norm_d(wkv_d(hm_t)))     (base rope_theta; no attn_norm)

then the block [g, noise, ..., noise] at positions p+1 .. p+N goes through the draft blocks (their own mHC trunk,
started like the backbone's: x0 in m streams, one-hot first pre); every block row attends to the main keys at
[p-W+1, p] and to all N draft keys of its layer (bidirectional), plus the sink; hb = the shifted mix (or the last
block's HC head); per draft i (prev_0 = g, prev_i = d_i):

    logits_i = norm(hb_i) @ head^T + markov_head.head(markov_head.embed[prev_i])
    conf_i   = sigmoid(clamp(proj · [hb_i ; markov_embed[prev_i]] / T, -60, 60))
    d_{i+1}  = argmax(logits_i) (greedy) or a draw from the request's shaped distribution with the counter RNG of
               §6.3 at seed + 1000000007 (the "mtp" stream), position p + 2 + i (the draft's own position)

Readings (the spec is silent; §16 has no draft items): the trunk entering a target layer is taken before its
Engram; the draft stack starts its own trunk with the one-hot first pre; the LM head "tied to the backbone" is the
backbone's head (embed when tie_word_embeddings); T is the request's temperature, 1e-5 for greedy (§6.3's greedy
temperature), so greedy confidences are close to 0 or 1; drafts after a stop token are not given confidence 0
here (the engine's rule, spec_decode/dspark.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepserve.kernels.reference.counter_rng import CASE_SAMPLE, sample_uniforms
from deepserve.kernels.reference.sampling import sample_from_probs, shaped_probs
from deepserve.models.reference.deepseek_v41 import (DeepseekV41Reference, ForwardState, apply_rope, hc_combine,
                                                     hc_head, rope_inv_freq, sink_attention)

MTP_SEED_OFFSET = 1000000007        # §6.3: the draft ("mtp") stream's seed offset
GREEDY_TEMPERATURE = 1e-5


@dataclass
class ReferenceDrafts:
    tokens: list[int]
    confidences: list[float]
    logits: torch.Tensor            # [N, V] fp32, Markov term included


def main_features(model: DeepseekV41Reference, ids: list[int]) -> torch.Tensor:
    """[T, |targets|·H] fp32: f_t of every position of `ids` (the target forward over them, traced)."""
    trace: dict = {}
    model(torch.tensor(ids), trace=trace)
    layers = trace["layers"]
    return torch.cat([layers[t]["block_trunk"].float().mean(1) for t in model.config.dspark_target_layer_ids], -1)


def main_keys(model: DeepseekV41Reference, features: torch.Tensor) -> list[torch.Tensor]:
    """Per draft layer, the main-cache keys [T, D] of positions 0..T-1."""
    first = model.mtp[0]
    hm = first.main_norm(first.main_proj(features.to(first.main_proj.weight.dtype)))
    positions = torch.arange(hm.shape[0])
    inv_freq = rope_inv_freq(model.config, None)
    return [apply_rope(blk.attn.kv_norm(blk.attn.wkv(hm)), positions, inv_freq) for blk in model.mtp]


def draft_hidden(model: DeepseekV41Reference, keys: list[torch.Tensor], g: int, num_drafts: int) -> torch.Tensor:
    """hb [N, H]: the block [g, noise...] at positions p+1 .. p+N (p = len(keys[d]) - 1) through the draft blocks."""
    c = model.config
    p, N, m, nH, D = keys[0].shape[0] - 1, num_drafts, c.hc_mult, c.num_attention_heads, c.head_dim
    block = torch.tensor([g] + [c.dspark_noise_token_id] * (N - 1))
    positions = torch.arange(p + 1, p + 1 + N)
    inv_freq = rope_inv_freq(c, None)
    main_visible = torch.arange(p + 1) >= p - c.sliding_window + 1                    # keys [p-W+1, p]
    mask = torch.cat((main_visible[None, :].expand(N, -1), torch.ones(N, N, dtype=torch.bool)), dim=1)
    x0 = model.embed.weight[block]
    R = x0[:, None, :].expand(N, m, c.hidden_size).contiguous()
    prev_pre = F.one_hot(torch.zeros(N, dtype=torch.long), m).float()
    state = ForwardState(None)
    for d, blk in enumerate(model.mtp):
        at = blk.attn

        def attention(u: torch.Tensor) -> torch.Tensor:
            a = blk.attn_norm(u)
            q = apply_rope(at.wq_b(at.q_norm(at.wq_a(a))).view(N, nH, D), positions, inv_freq)
            kv = apply_rope(at.kv_norm(at.wkv(a)), positions, inv_freq)                 # the block's own keys
            o = sink_attention(q, torch.cat((keys[d], kv)), mask, at.attn_sink, D)
            o = apply_rope(o.to(a.dtype), positions, inv_freq, inverse=True)
            return at.wo_b(at.grouped_wv(o))

        R, prev_pre = blk.sublayer(R, prev_pre, "hc_attn", attention, state)
        R, prev_pre = blk.sublayer(R, prev_pre, "hc_ffn", lambda u: blk.ffn(blk.ffn_norm(u)), state)
    last = model.mtp[-1]
    if c.hc_shifted:
        return hc_combine(R, prev_pre)
    return hc_head(R, last.hc_head_fn, last.hc_head_base, last.hc_head_scale, c)


@torch.inference_mode()
def reference_drafts(model: DeepseekV41Reference, tokens: list[int], num_drafts: int, temperature: float = 0.0,
                     seed: int = 0, top_k: int = -1, top_p: float = 1.0) -> ReferenceDrafts:
    """The N drafts (and raw confidences) DSpark makes for a sequence whose tokens are `tokens`: positions
    0..p = len - 2 are committed (their main keys exist), g = tokens[-1] is the newest token."""
    c = model.config
    keys = main_keys(model, main_features(model, tokens[:-1]))
    hb = draft_hidden(model, keys, tokens[-1], num_drafts)
    last = model.mtp[-1]
    head = model.embed.weight if c.tie_word_embeddings else model.head.weight
    base = last.norm(hb).float() @ head.float().T
    w_c = last.confidence_head.proj.weight.float()[0]
    T = temperature if temperature > GREEDY_TEMPERATURE else GREEDY_TEMPERATURE
    prev, drafts, confs, rows = tokens[-1], [], [], []
    p = len(tokens) - 2
    V = base.shape[-1]
    for i in range(num_drafts):
        e = last.markov_head.embed.weight[prev].float()
        logits = base[i] + last.markov_head.head.weight.float() @ e
        confs.append(float(torch.sigmoid((w_c @ torch.cat((hb[i].float(), e)) / T).clamp(-60, 60))))
        if temperature <= GREEDY_TEMPERATURE:
            prev = int(logits.argmax())
        else:
            probs = shaped_probs(logits[None], torch.tensor([temperature]),
                                 torch.tensor([top_k if 0 < top_k < V else V]), torch.tensor([top_p]))
            u = sample_uniforms([seed + MTP_SEED_OFFSET], [p + 2 + i], CASE_SAMPLE)
            prev = int(sample_from_probs(probs, torch.from_numpy(u))[0])
        drafts.append(prev)
        rows.append(logits)
    return ReferenceDrafts(drafts, confs, torch.stack(rows))
