"""DeepSeek-V2 / V3 (MLA + DeepSeekMoE) against HF transformers, and the latent cache's layout and math."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hf_compare import (assert_close_relative, check_alone, check_mixed_batch, engine_logits, hf_logits, load_hf,
                        save_tiny)

from deepserve import LLM, SamplingParams
from deepserve.layers.mla import MLAWeights, absorbed_attention, expanded_attention

KV_LORA, ROPE, LAYERS = 32, 8, 3
MLA = dict(vocab_size=512, hidden_size=64, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
           max_position_embeddings=256, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
           num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=KV_LORA,
           qk_rope_head_dim=ROPE, qk_nope_head_dim=16, v_head_dim=16)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=32,
            beta_slow=1, mscale=1.0, mscale_all_dim=0.707)

VARIANTS = {
    # V2: softmax router limited to the best 2 of 4 expert groups, scaled; no q compression.
    "v2": (2, dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5,
                   q_lora_rank=None)),
    # V3: sigmoid + correction bias, grouped top-k (noaux_tc), renormalised and scaled; q through q_lora.
    "v3": (3, dict(n_group=4, topk_group=2, q_lora_rank=48, routed_scaling_factor=2.5)),
    # V3 with YaRN (mscale != mscale_all_dim: cos/sin and the softmax scale both change) and NeoX rope.
    "v3_yarn_neox": (3, dict(n_group=2, topk_group=1, q_lora_rank=None, rope_interleave=False,
                             rope_parameters=YARN)),
}


def _write(version: int, overrides: dict, path) -> str:
    import transformers

    cls = {2: (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
           3: (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM)}[version]
    return save_tiny(path, cls[0](**{**MLA, **overrides}), cls[1], bias_std=0.1)


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory):
    cache = {}

    def get(name: str):
        if name not in cache:
            version, overrides = VARIANTS[name]
            path = _write(version, overrides, tmp_path_factory.mktemp(name))
            cache[name] = (path, load_hf(path))
        return cache[name]
    return get


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logits_and_greedy_match_hf(tiny_deepseek, name):
    path, hf = tiny_deepseek(name)
    llm = check_alone(path, hf)
    assert len(llm.engine.runner.model.moe_layers()) == LAYERS - 1      # first_k_dense_replace = 1


@pytest.mark.parametrize("name", ["v2", "v3"])
def test_mixed_batch_matches_hf(tiny_deepseek, name):
    path, hf = tiny_deepseek(name)
    check_mixed_batch(path, hf, kv_bytes_per_token=LAYERS * (KV_LORA + ROPE) * 4)


def test_legacy_rope_scaling_config(tmp_path):
    """Released checkpoints spell YaRN as `rope_theta` + `rope_scaling: {type: yarn, ...}`."""
    path = _write(2, dict(q_lora_rank=None, rope_parameters=YARN), tmp_path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    params["type"] = params.pop("rope_type")
    cfg["rope_scaling"] = params
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    hf = load_hf(path)
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    check_alone(path, hf)


def test_latent_cache_holds_only_latent_and_rope_key(tiny_deepseek):
    path, _ = tiny_deepseek("v3")
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8)
    runner = llm.engine.runner
    layers = runner.model.attention_layers()
    assert len(layers) == LAYERS
    for layer in layers:
        assert layer.kv_bytes_per_token(torch.float32) == (KV_LORA + ROPE) * 4
        assert layer.kv_bytes_per_token(torch.bfloat16) == (KV_LORA + ROPE) * 2
        assert tuple(layer.kv_cache.shape) == (runner.config.cache.num_blocks, 8, KV_LORA + ROPE)
    assert runner.kv_bytes_per_token() == LAYERS * (KV_LORA + ROPE) * 4


def test_absorbed_decode_equalsexpanded_attention():
    """The decode form (W_UK folded into q, W_UV into the output) equals expanding every cached token."""
    gen = torch.Generator().manual_seed(0)
    heads, nope, v, length = 4, 16, 12, 19
    w = MLAWeights(torch.randn(heads, nope, KV_LORA, generator=gen), torch.randn(heads, v, KV_LORA, generator=gen))
    cached = torch.randn(length, KV_LORA + ROPE, generator=gen)
    q_nope = torch.randn(1, heads, nope, generator=gen)
    q_pe = torch.randn(1, heads, ROPE, generator=gen)
    scale = 0.11
    expanded = expanded_attention(q_nope, q_pe, cached, length - 1, w, KV_LORA, scale)
    mask = torch.ones(1, length, dtype=torch.bool)
    absorbed = absorbed_attention(q_nope, q_pe, cached[None], mask, w, KV_LORA, scale)
    torch.testing.assert_close(absorbed, expanded, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["v2", "v3"])
def test_dummy_weights_run(tiny_deepseek, name):
    path, _ = tiny_deepseek(name)
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", load_format="dummy", block_size=8)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


@pytest.mark.parametrize("name,kv", [("v2", "fp8"), ("v3", "fp8_e5m2")])
def test_fp8_latent_cache_matches_hf_with_rounded_latents(tiny_deepseek, name, kv, monkeypatch):
    """kv_cache_dtype fp8 on MLA: the latent and the rotated k_pe are cached as 8-bit floats. The reference is HF
    with its `expand_kv` (the latents -> keys and values step, given the cached normalised latent and the rotated
    k_pe) fed those two rounded the same way: clamped to the format's largest value, then cast."""
    import transformers
    dtype = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv]
    path, _ = tiny_deepseek(name)
    cls = {"v2": transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Attention,
           "v3": transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention}[name]
    expand = cls.expand_kv
    limit = torch.finfo(dtype).max

    def rounded(x):
        return x.clamp(-limit, limit).to(dtype).to(x.dtype)

    monkeypatch.setattr(cls, "expand_kv", lambda self, kv_nope, k_rot: expand(self, rounded(kv_nope), rounded(k_rot)))
    hf = load_hf(path)
    llm = check_alone(path, hf, kv_cache_dtype=kv)
    assert all(c.dtype == dtype for c in llm.engine.runner.kv_caches)
    monkeypatch.setattr(cls, "expand_kv", expand)        # the rounding matters: plain HF is far off
    ids = list(range(5, 40))
    with pytest.raises(AssertionError):
        assert_close_relative(engine_logits(llm, ids), hf_logits(load_hf(path), ids), 1e-3)
