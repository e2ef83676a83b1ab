"""deepseek_v4_config (models/deepseek_v4_config.py): transformers' DeepseekV4 config.json -> DeepseekV41Config with
the V4 fields, checked against transformers' own reading of the same dicts (its DeepseekV4Config and its rotary
embedding), on its default config, the released DeepSeek-V4-Flash config and tiny ones; plus the V4 validation,
and that V4.1's stays as strict."""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding  # noqa: E402

from deepserve.models.deepseek_v4_config import deepseek_v4_config  # noqa: E402
from deepserve.models.deepseek_v41_config import CSA, HCA, WINDOW, DeepseekV41Config  # noqa: E402
from deepserve.models.reference.deepseek_v41 import rope_inv_freq  # noqa: E402
from deepserve.models.reference.tiny import tiny_config  # noqa: E402

HF_TYPE = {"sliding_attention": WINDOW, "compressed_sparse_attention": CSA, "heavily_compressed_attention": HCA}
W, C, H_ = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

# The released DeepSeek-V4-Flash config.json (legacy shape: per-layer compress_ratios with one more entry for the
# MTP layer, num_hash_layers, qk_rope_head_dim, a flat rope_scaling).
FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 1, "hc_eps": 1e-06, "hc_mult": 4, "hc_sinkhorn_iters": 20, "head_dim": 512,
    "hidden_act": "silu", "hidden_size": 4096, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 512,
    "initializer_range": 0.02, "max_position_embeddings": 1048576, "model_type": "deepseek_v4",
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 64, "num_experts_per_tok": 6, "num_hidden_layers": 43, "num_hash_layers": 3,
    "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 8, "o_lora_rank": 1024,
    "q_lora_rank": 1024, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "sliding_window": 128,
    "swiglu_limit": 10.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 129280,
    "compress_rope_theta": 160000, "topk_method": "noaux_tc",
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}
TINY = dict(vocab_size=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
            partial_rotary_factor=0.25, q_lora_rank=24, o_lora_rank=16, o_groups=2, moe_intermediate_size=16,
            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, hc_mult=4, sliding_window=4,
            index_n_heads=8, index_head_dim=16, index_topk=3, max_position_embeddings=512,
            num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=1, pad_token_id=2)
TINY_MIXES = {
    "window_csa4_hca8_yarn": dict(TINY, num_hidden_layers=4, layer_types=[W, C, H_, C],
                                  compress_rates={C: 4, H_: 8}, mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
                                  rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=16,
                                                    beta_fast=32, beta_slow=1)),
    "hca4_csa2_window": dict(TINY, num_hidden_layers=3, layer_types=[H_, C, W], compress_rates={C: 2, H_: 4},
                             mlp_layer_types=["hash_moe", "hash_moe", "moe"]),
    "no_hash_default_types": dict(TINY, num_hidden_layers=5, mlp_layer_types=["moe"] * 5),
    # YaRN with transformers' beta defaults (32 / 1) at a size where beta_fast moves the ramp (R = 32).
    "yarn_beta_defaults": dict(TINY, num_hidden_layers=2, head_dim=64, partial_rotary_factor=0.5, index_head_dim=32,
                               layer_types=[W, C], rope_scaling=dict(type="yarn", factor=8.0,
                                                                     original_max_position_embeddings=4096)),
}
CASES = {"default": {}, "flash": FLASH, **TINY_MIXES}


def hf(raw: dict):
    return transformers.DeepseekV4Config(**{k: v for k, v in raw.items() if k != "model_type"})


def raw_dict(raw: dict) -> dict:
    return {"model_type": "deepseek_v4", **raw}


@pytest.mark.parametrize("case", list(CASES))
def test_translation_agrees_with_transformers(case):
    """Both shapes of one config (as written, and transformers' to_dict) translate alike, and every field agrees
    with transformers' reading: layer types and ratios, hash layers, rope dim, thetas and YaRN (through the
    inverse frequencies transformers' rotary embedding computes)."""
    h = hf(CASES[case])
    c = deepseek_v4_config(h.to_dict())
    assert deepseek_v4_config(raw_dict(CASES[case])) == c
    L = h.num_hidden_layers
    assert c.is_v4 and c.num_hidden_layers == L and c.model_type == "deepseek_v4"
    assert c.layer_types == tuple(HF_TYPE[t] for t in h.layer_types)
    assert c.compress_ratios == tuple(0 if t == W else h.compress_rates[t] for t in h.layer_types)
    assert c.num_hash_layers == h.mlp_layer_types.count("hash_moe")
    assert [c.is_hash_moe(l) for l in range(L)] == [t == "hash_moe" for t in h.mlp_layer_types]
    assert c.qk_rope_head_dim == h.qk_rope_head_dim
    for name in ("hidden_size", "num_attention_heads", "head_dim", "q_lora_rank", "o_lora_rank", "o_groups",
                 "hc_mult", "hc_eps", "hc_sinkhorn_iters", "index_topk", "index_n_heads", "index_head_dim",
                 "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "routed_scaling_factor",
                 "swiglu_limit", "sliding_window", "rms_norm_eps", "vocab_size", "tie_word_embeddings"):
        assert getattr(c, name) == getattr(h, name), name
    rotary = DeepseekV4RotaryEmbedding(h)
    for l in range(L):
        want = rotary.main_inv_freq if c.layer_types[l] == WINDOW else rotary.compress_inv_freq
        torch.testing.assert_close(rope_inv_freq(c, l).float(), want, rtol=1e-6, atol=0)


def test_released_flash_config():
    c = deepseek_v4_config(FLASH)
    assert c.num_hidden_layers == 43 and len(c.compress_ratios) == 43          # the MTP entry is dropped
    assert c.layer_types[:4] == (WINDOW, WINDOW, CSA, HCA) and c.compress_ratios[:4] == (0, 0, 4, 128)
    assert c.layer_types[-1] == CSA and c.num_hash_layers == 3 and c.qk_rope_head_dim == 64
    assert (c.rope_theta, c.compress_rope_theta) == (10000.0, 160000.0)
    assert (c.rope_scaling.factor, c.rope_scaling.original_max_position_embeddings) == (16.0, 65536)
    assert c.layer_yarn(0) is None and c.layer_yarn(2) == c.rope_scaling and c.layer_rope_theta(0) == 10000.0
    assert c.num_nextn_predict_layers == 0 and c.n_shared_experts == 1 and c.index_topk == 512


def test_transformers_defaults_are_mirrored():
    """A config that leaves everything out reads as transformers' defaults (V4-Pro-like types: 2 HCA, then HCA /
    CSA alternating; no YaRN; 3 hash layers)."""
    c = deepseek_v4_config({"model_type": "deepseek_v4"})
    assert c == deepseek_v4_config(transformers.DeepseekV4Config().to_dict())
    assert c.layer_types[:4] == (HCA, HCA, HCA, CSA) and c.compress_ratios[:4] == (128, 128, 128, 4)
    assert c.rope_scaling is None and c.num_hash_layers == 3 and c.hidden_size == 4096


def test_v4_roles_and_internals():
    c = deepseek_v4_config(raw_dict(TINY_MIXES["window_csa4_hca8_yarn"]))
    assert c.layer_types == (WINDOW, CSA, HCA, CSA)
    assert [c.compress_span(l) for l in range(4)] == [0, 8, 8, 8]             # CSA 2·4 overlapping, HCA 8
    assert [c.is_sparse(l) for l in range(4)] == [False, True, False, True]  # HCA attends to all its entries
    assert [c.is_index_source(l) for l in range(4)] == [False, True, False, True]
    assert [c.is_index_k_source(l) for l in range(4)] == [False, True, False, True]
    assert [c.is_kv_source(l) for l in range(4)] == [False, True, True, True]
    assert c.kv_map == c.index_map == c.index_k_map == (0, 1, 2, 3) and c.n_prefill_layer == 4
    assert (c.hc_shifted, c.use_qnorm, c.use_ape, c.compress_overlap, c.indexer_kproj) == (False, True, True, True,
                                                                                            False)
    assert c.num_key_value_heads == 1 and c.topk_method == "noaux_tc" and c.norm_topk_prob is True
    assert c.layer_rope_theta(0) == c.rope_theta and c.layer_rope_theta(1) == c.compress_rope_theta
    assert c.layer_yarn(0) is None and c.layer_yarn(2).factor == 4.0


def test_legacy_rate_overrides_and_expert_dtype():
    raw = dict(FLASH, compress_rate_csa=2, compress_rate_hca=8, expert_dtype="fp4",
               quantization_config={"quant_method": "fp8"})
    c = deepseek_v4_config(raw)
    h = hf(raw)
    assert c.compress_ratios[:4] == (0, 0, 2, 8) == tuple(0 if t == W else h.compress_rates[t]
                                                         for t in h.layer_types[:4])
    assert c.quantization_config == {"quant_method": "fp8", "expert_dtype": "fp4"}


V4_BAD = [
    (dict(model_type="deepseek_v41"), "model_type='deepseek_v41'"),
    (dict(architectures=["DeepseekV41ForCausalLM"]), "architectures"),
    (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(mlp_bias=True), "mlp_bias=True"),
    (dict(swiglu_limit=0), "swiglu_limit=0"),
    (dict(compress_ratios=[0, 0, 2] + [4] * 41), "compress_ratios[2]=2"),
    (dict(mlp_layer_types=["moe", "hash_moe"] + ["moe"] * 41), "hash_moe layers must all come before"),
    (dict(layer_types=["full_attention"] * 43), "layer_types[0]='full_attention'"),
    (dict(layer_types=[W] * 42), "needs num_hidden_layers=43"),
    (dict(index_topk=0), "index_topk=0"),
    (dict(rope_scaling=None, rope_parameters={"main": {"rope_type": "default", "rope_theta": 1e4},
                                              "compress": {"rope_type": "yarn", "rope_theta": 1.6e5, "factor": 16,
                                                           "original_max_position_embeddings": 65536}}),
     "attention_factor=None"),
    (dict(rope_scaling=None, rope_parameters={"main": {"rope_type": "linear", "factor": 2.0},
                                              "compress": {"rope_type": "default"}}), "main.rope_type='linear'"),
    (dict(rope_scaling=dict(type="yarn", factor=4, original_max_position_embeddings=2, beta_fast=32,
                            beta_slow=1)), "outside [0, 63]"),
]


@pytest.mark.parametrize("overrides,message", V4_BAD, ids=[m for _, m in V4_BAD])
def test_v4_errors_name_the_field(overrides, message):
    with pytest.raises(ValueError) as err:
        deepseek_v4_config({**FLASH, **overrides})
    assert message in str(err.value)


V4_FIELD_BAD = [
    (dict(hc_shifted=True), "hc_shifted=True"),
    (dict(use_ape=False), "use_ape=False"),
    (dict(indexer_kproj=True), "indexer_kproj=True"),
    (dict(num_hash_layers=44), "num_hash_layers=44"),
    (dict(kv_source_layer_ids=(2,)), "kv_source_layer_ids=(2,)"),
    (dict(engram_layer_ids=(1,)), "engram_layer_ids=[1]"),
    (dict(attention_types=(CSA,) + (WINDOW,) * 42), "compress_ratios[0]=0"),
    (dict(attention_types=(WINDOW,) * 42), "attention_types="),
]


@pytest.mark.parametrize("overrides,message", V4_FIELD_BAD, ids=[m for _, m in V4_FIELD_BAD])
def test_v4_validation_in_the_config(overrides, message):
    good = deepseek_v4_config(FLASH)
    with pytest.raises(ValueError) as err:
        dataclasses.replace(good, **overrides)
    assert message in str(err.value)


def test_v41_stays_strict():
    """V4's values are accepted only with model_type deepseek_v4: a V4.1 config keeps ratios {0, 1, 2}, its
    internals, and has no attention_types; from_hf_dict still reads V4.1 only."""
    base = DeepseekV41Config.from_hf_dict(tiny_config("c2"))
    assert not base.is_v4 and base.layer_types == ("window", "c2", "c2", "c2") and not base.is_hash_moe(0)
    assert [base.compress_span(l) for l in range(4)] == [0, 2, 2, 2]
    for overrides, message in [(dict(compress_ratios=(0, 4, 4, 4, 0)), "compress_ratios[1]=4"),
                               (dict(attention_types=("window", "csa", "csa", "csa")), "DeepSeek-V4 only"),
                               (dict(use_ape=True), "use_ape=True"), (dict(num_hash_layers=1), "num_hash_layers=1"),
                               (dict(model_type="deepseek_v5"), "model_type='deepseek_v5'")]:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
            dataclasses.replace(base, **overrides)
    with pytest.raises(ValueError, match="model_type='deepseek_v4'"):
        DeepseekV41Config.from_hf_dict(tiny_config("c2", model_type="deepseek_v4"))
