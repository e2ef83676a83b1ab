"""Tiny random DeepSeek-V4.1 models (§2.13): HF-style configs of every layer-type mix, and weights scaled so that
routing, compression and the indexer actually decide something (not near-uniform random noise)."""

from __future__ import annotations

import math
from typing import Any

import torch

from deepserve.models.reference.deepseek_v41 import DeepseekV41Reference


def init_tiny_weights(model: DeepseekV41Reference, seed: int = 0) -> DeepseekV41Reference:
    """Random weights for a tiny model that exercise every path (§2.13): container-style mHC init (§2.4) plus
    dynamic fn so Sinkhorn mixing varies per token, non-zero sinks, gate scales and biases large enough that
    routing (and biased vs unbiased scores) matter, a sharp C2 gate, norms near 1, projections ~1/sqrt(in)."""
    c = model.config
    g = torch.Generator().manual_seed(seed)
    m, H, L = c.hc_mult, c.hidden_size, c.num_hidden_layers

    def normal(shape, std=1.0, mean=0.0):
        return torch.randn(shape, generator=g) * std + mean

    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            shape = tuple(p.shape)
            if leaf in ("hc_attn_base", "hc_ffn_base"):
                parts = name.split(".")
                layer = int(parts[1]) + (L if parts[0] == "mtp" else 0)
                base = torch.cat((torch.full((m,), -c.hc_pre_init), torch.full((m,), c.hc_post_init),
                                  (2 * torch.eye(m) - 1).flatten() * c.hc_res_init))
                base[layer % m] = c.hc_pre_init
                value = base + normal(shape)
            elif leaf in ("hc_attn_fn", "hc_ffn_fn", "hc_head_fn"):
                value = normal(shape, 1 / math.sqrt(m * H))
            elif leaf in ("hc_attn_scale", "hc_ffn_scale"):
                value = 0.5 + torch.rand(shape, generator=g) * 0.5
            elif leaf == "hc_head_scale":
                value = torch.ones(shape)
            elif leaf == "hc_head_base":
                value = normal(shape, 0.5)
            elif leaf == "attn_sink":
                value = normal(shape)
            elif name.endswith("gate.bias") or name.endswith("gate.bias_vl"):
                value = normal(shape, 0.3)
            elif name.endswith("gate.weight"):
                value = normal(shape, 2 / math.sqrt(shape[1]))
            elif name.endswith("compressor.wgate.weight"):
                value = normal(shape, 3 / math.sqrt(shape[1]))
            elif leaf in ("q_weight", "k_weight") or name.endswith("norm.weight"):
                value = normal(shape, 0.1, 1.0)
            elif "embed" in name:                                           # embeddings, engram tables
                value = normal(shape)
            else:
                value = normal(shape, 1 / math.sqrt(shape[-1]))
            p.copy_(value.to(p.dtype))
    return model


def tiny_config(variant: str = "mixed", **overrides: Any) -> dict[str, Any]:
    """An HF-style config.json dict of a tiny V4.1 model. Variants:
      window    3 window layers (SWA only)               c1 / c2   window + 3 C1 / C2 layers, each its own source
      mixed     [0, 2, 2, 1, 1, 1] + 1 draft: kv sources [1, 3], index sources [1, 3, 5] (5 reads 3's index K),
                candidate source 3 (consumer 5), YOCO split at 3
      shared    [0, 2, 2, 1, 1, 1, 1]: kv sources [1, 3, 5] (5: a second consumer-half KV source), index [1, 3, 4, 5]
      engram    mixed + Engram on layers 0 and 3          unshifted  mixed with hc_shifted False (HC head)
    overrides set text_config keys (top-level ones for model_type / architectures / dtype / *_token_id /
    quantization_config); an override of None removes the key."""
    text: dict[str, Any] = dict(
        num_hidden_layers=6, hidden_size=32, num_attention_heads=4, num_key_value_heads=1, vocab_size=96,
        max_position_embeddings=256, rms_norm_eps=1e-6, swiglu_limit=2.0, tie_word_embeddings=False,
        sliding_window=4, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_scaling=dict(type="yarn", original_max_position_embeddings=16, factor=4.0, beta_fast=32, beta_slow=1),
        q_lora_rank=24, head_dim=32, qk_rope_head_dim=8, o_lora_rank=16, o_groups=2,
        hc_mult=4, hc_shifted=True, hc_eps=1e-6, hc_sinkhorn_iters=20,
        compress_ratios=[0, 2, 2, 1, 1, 1, 0], index_topk=3, index_n_heads=2, index_head_dim=16,
        kv_source_layer_ids=[1, 3], index_source_layer_ids=[1, 3, 5], candidate_source_layer_id=3,
        candidate_topk_blocks=8, candidate_block_size=2, use_fp4_sparse_kv=True,
        moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", norm_topk_prob=True, topk_method="noaux_tc",
        hidden_act="silu", attention_bias=False, attention_dropout=0.0,
        num_nextn_predict_layers=1, dspark_block_size=4, dspark_target_layer_ids=[4, 5], dspark_target_attn_input=True,
        dspark_markov_rank=8, dspark_noise_token_id=3, dspark_n_routed_experts=4, dspark_num_experts_per_tok=1,
        engram_layer_ids=[], engram_max_ngram_size=3, engram_vocab_size=50, engram_n_heads=2, engram_head_dim=8,
        engram_compressed_vocab_size=None, engram_pad_token_id=2,
    )
    no_sharing = dict(kv_source_layer_ids=None, index_source_layer_ids=None, candidate_source_layer_id=None)
    variants: dict[str, dict[str, Any]] = {
        "mixed": {},
        "window": dict(num_hidden_layers=3, compress_ratios=[0, 0, 0, 0], dspark_target_layer_ids=[1, 2],
                       **no_sharing),
        "c1": dict(num_hidden_layers=4, compress_ratios=[0, 1, 1, 1, 0], dspark_target_layer_ids=[2, 3], **no_sharing),
        "c2": dict(num_hidden_layers=4, compress_ratios=[0, 2, 2, 2, 0], dspark_target_layer_ids=[2, 3], **no_sharing),
        "shared": dict(num_hidden_layers=7, compress_ratios=[0, 2, 2, 1, 1, 1, 1, 0], kv_source_layer_ids=[1, 3, 5],
                       index_source_layer_ids=[1, 3, 4, 5], dspark_target_layer_ids=[5, 6]),
        "engram": dict(engram_layer_ids=[0, 3]),
        "unshifted": dict(hc_shifted=False),
    }
    if variant not in variants:
        raise ValueError(f"tiny_config: unknown variant {variant!r} (one of {sorted(variants)})")
    text.update(variants[variant])
    top: dict[str, Any] = dict(model_type="deepseek_v41", architectures=["DeepseekV41ForCausalLM"], dtype="bfloat16",
                               bos_token_id=0, eos_token_id=1, pad_token_id=2)
    top_level = {"model_type", "architectures", "dtype", "torch_dtype", "bos_token_id", "eos_token_id",
                 "pad_token_id", "quantization_config", "vision_config"}
    for key, value in overrides.items():
        target = top if key in top_level else text
        if value is None:
            target.pop(key, None)
        else:
            target[key] = value
    for key in [k for k, v in text.items() if v is None]:
        del text[key]
    top["text_config"] = text
    return top
