"""DeepSeek-V4 (`DeepseekV4ForCausalLM`, model_type "deepseek_v4") config.json -> DeepseekV41Config with V4's fields.

`deepseek_v4_config(hf_config)` reads a V4 config dict the way transformers 5.24's DeepseekV4Config does, in
either of the two shapes one meets:
  released   per-layer `compress_ratios` (0 / 4 / 128, plus one entry for the MTP layer), `num_hash_layers`,
             `qk_rope_head_dim`, a flat `rope_scaling` (YaRN, applied to the compressed layers only);
  transformers' own (`DeepseekV4Config(...).to_dict()`): `layer_types`, `compress_rates`, `mlp_layer_types`,
             `partial_rotary_factor`, `rope_parameters` {"main": ..., "compress": ...}.
An absent (or null) key takes transformers' default (V4_DEFAULTS). What transformers ignores is normalised to what
its model does (one KV head, one shared expert of moe_intermediate_size, always-renormalised routing, no MTP
layer). What our engine cannot reproduce is a ValueError naming the field. docs/deepseek_v4.md has the formulas.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from deepserve.models.deepseek_v41_config import (CSA, HCA, V4_INTERNALS, V4_MODEL_TYPE, WINDOW, DeepseekV41Config,
                                                  YarnScaling)

ARCHITECTURE = "DeepseekV4ForCausalLM"
HF_CSA, HF_HCA, HF_WINDOW = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
HF_LAYER_TYPES = {HF_WINDOW: WINDOW, HF_CSA: CSA, HF_HCA: HCA}
LEGACY_RATIO_TYPES = {0: HF_WINDOW, 4: HF_CSA, 128: HF_HCA}      # transformers maps only these three ratios

# transformers' DeepseekV4Config defaults (configuration_deepseek_v4.py), for keys a config leaves out.
V4_DEFAULTS: dict[str, Any] = dict(
    vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43, num_attention_heads=64,
    head_dim=512, q_lora_rank=1024, num_experts_per_tok=6, n_routed_experts=256, scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5, max_position_embeddings=1048576, rope_theta=10000.0, compress_rope_theta=160000.0,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1.0e-6, swiglu_limit=10.0, sliding_window=128, o_groups=8,
    o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512, hidden_act="silu", rms_norm_eps=1.0e-6,
    tie_word_embeddings=False, attention_bias=False, mlp_bias=False, attention_dropout=0.0)
DEFAULT_COMPRESS_RATES = {HF_CSA: 4, HF_HCA: 128}
DEFAULT_NUM_HASH_LAYERS = 3
DEFAULT_PARTIAL_ROTARY_FACTOR = 64 / 512
TOKEN_DEFAULTS = dict(pad_token_id=None, bos_token_id=0, eos_token_id=1)   # null here means "none"


def _fail(name: str, value: Any, why: str) -> ValueError:
    return ValueError(f"deepseek_v4_config: {name}={value!r}: {why}")


def deepseek_v4_config(hf_config: Mapping[str, Any]) -> DeepseekV41Config:
    """A DeepSeek-V4 config.json dict -> DeepseekV41Config(model_type="deepseek_v4", ...)."""
    cfg = dict(hf_config)
    if cfg.get("model_type") != V4_MODEL_TYPE:
        raise _fail("model_type", cfg.get("model_type"), f"must be {V4_MODEL_TYPE!r}")
    archs = cfg.get("architectures")
    if archs is not None and list(archs) != [ARCHITECTURE]:
        raise _fail("architectures", archs, f"must be [{ARCHITECTURE!r}] (or absent)")
    get = lambda name: V4_DEFAULTS[name] if cfg.get(name) is None else cfg[name]  # noqa: E731
    for name in ("attention_bias", "mlp_bias"):                  # the shared expert takes mlp_bias in transformers
        if get(name):
            raise _fail(name, cfg[name], "biases are not supported (must be false)")
    if not get("swiglu_limit"):
        raise _fail("swiglu_limit", cfg.get("swiglu_limit"), "transformers always clamps with it: must be positive")

    L = int(get("num_hidden_layers"))
    types, ratios = attention_types(cfg, L)
    head_dim = int(get("head_dim"))
    rope_dim = rope_head_dim(cfg, head_dim)
    rope_theta, compress_theta, yarn = rope_settings(cfg, rope_dim)
    kwargs: dict[str, Any] = {name: get(name) for name in (
        "vocab_size", "hidden_size", "num_attention_heads", "max_position_embeddings", "rms_norm_eps",
        "tie_word_embeddings", "sliding_window", "q_lora_rank", "o_lora_rank", "o_groups", "hc_mult", "hc_eps",
        "hc_sinkhorn_iters", "index_topk", "index_n_heads", "index_head_dim", "moe_intermediate_size",
        "n_routed_experts", "num_experts_per_tok", "routed_scaling_factor", "swiglu_limit", "hidden_act",
        "attention_dropout", "scoring_func")}
    kwargs.update({name: cfg.get(name, default) for name, default in TOKEN_DEFAULTS.items()})
    if isinstance(kwargs["eos_token_id"], list):
        kwargs["eos_token_id"] = tuple(kwargs["eos_token_id"])
    return DeepseekV41Config(
        **kwargs, num_hidden_layers=L, head_dim=head_dim, qk_rope_head_dim=rope_dim,
        rope_theta=float(rope_theta), compress_rope_theta=float(compress_theta), rope_scaling=yarn,
        compress_ratios=ratios, attention_types=types, num_hash_layers=num_hash_layers(cfg, L),
        quantization_config=quantization_config(cfg),
        # What transformers' model does whatever the config says: one KV head (kv_proj -> head_dim, broadcast),
        # one shared expert of moe_intermediate_size (DeepseekV4MLP), renormalised bias-steered top-k routing,
        # and no MTP layer (its `mtp.*` weights are ignored on load).
        num_key_value_heads=1, n_shared_experts=1, norm_topk_prob=True, topk_method="noaux_tc",
        num_nextn_predict_layers=0, hc_shifted=False, model_type=V4_MODEL_TYPE, **V4_INTERNALS)


def attention_types(cfg: Mapping[str, Any], L: int) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Per layer (type, compress ratio), as transformers resolves them: `layer_types` > the legacy per-layer
    `compress_ratios` > its default (2 HCA, then HCA / CSA alternating); ratios from `compress_rates` (default 4 /
    128) with the legacy `compress_rate_csa` / `compress_rate_hca` folded in. Lists are cut to L (the release
    lists one more entry, for the MTP layer)."""
    rates = dict(cfg.get("compress_rates") or DEFAULT_COMPRESS_RATES)
    for key, hf_type in (("compress_rate_csa", HF_CSA), ("compress_rate_hca", HF_HCA)):
        if cfg.get(key) is not None:
            rates[hf_type] = cfg[key]
    names = cfg.get("layer_types")
    if names is None and cfg.get("compress_ratios") is not None:
        names = []
        for i, r in enumerate(cfg["compress_ratios"]):
            if r not in LEGACY_RATIO_TYPES:
                raise _fail(f"compress_ratios[{i}]", r, "must be 0, 4 or 128 (the ratios transformers maps to "
                            "layer types; other rates go in compress_rates)")
            names.append(LEGACY_RATIO_TYPES[r])
    if names is None:
        names = [HF_HCA] * min(L, 2) + [HF_CSA if i % 2 else HF_HCA for i in range(max(L - 2, 0))]
    names = list(names)[:L]
    if len(names) != L:
        raise _fail("layer_types", names, f"needs num_hidden_layers={L} entries")
    types, ratios = [], []
    for i, name in enumerate(names):
        if name not in HF_LAYER_TYPES:
            raise _fail(f"layer_types[{i}]", name, f"must be one of {sorted(HF_LAYER_TYPES)}")
        ratio = 0 if name == HF_WINDOW else rates.get(name)
        if name != HF_WINDOW and (not isinstance(ratio, int) or isinstance(ratio, bool) or ratio <= 0):
            raise _fail(f"compress_rates[{name!r}]", ratio, "must be a positive integer")
        types.append(HF_LAYER_TYPES[name])
        ratios.append(ratio)
    return tuple(types), tuple(ratios)


def num_hash_layers(cfg: Mapping[str, Any], L: int) -> int:
    """How many first layers route by token hash: `mlp_layer_types` > legacy `num_hash_layers` > 3. Our config
    holds a count, so the hash layers must come first (they do in every V4 release)."""
    kinds = cfg.get("mlp_layer_types")
    if kinds is None:
        n = cfg.get("num_hash_layers")
        n = DEFAULT_NUM_HASH_LAYERS if n is None else int(n)
        return min(max(n, 0), L)
    kinds = list(kinds)[:L]
    if len(kinds) != L or any(k not in ("hash_moe", "moe") for k in kinds):
        raise _fail("mlp_layer_types", kinds, f"needs num_hidden_layers={L} entries of 'hash_moe' / 'moe'")
    n = next((i for i, k in enumerate(kinds) if k != "hash_moe"), L)
    if "hash_moe" in kinds[n:]:
        raise _fail("mlp_layer_types", kinds, "hash_moe layers must all come before the first moe layer")
    return n


def rope_head_dim(cfg: Mapping[str, Any], head_dim: int) -> int:
    """R = int(head_dim · partial_rotary_factor), the factor defaulting to the legacy qk_rope_head_dim / head_dim,
    else 64 / 512 (transformers' order)."""
    factor = cfg.get("partial_rotary_factor")
    if factor is None:
        legacy = cfg.get("qk_rope_head_dim")
        factor = DEFAULT_PARTIAL_ROTARY_FACTOR if legacy is None else legacy / head_dim
    return int(head_dim * factor)


def rope_settings(cfg: Mapping[str, Any], rope_dim: int) -> tuple[float, float, YarnScaling | None]:
    """(window-layer theta, compressed-layer theta, YaRN of the compressed layers or None)."""
    main, compress = rope_parameters(cfg)
    if main.get("rope_type", main.get("type", "default")) != "default":
        raise _fail("rope_parameters.main.rope_type", main.get("rope_type"), "window layers use plain RoPE only")
    kind = compress.get("rope_type", compress.get("type", "default"))
    if kind == "default":
        return main["rope_theta"], compress["rope_theta"], None
    if kind != "yarn":
        raise _fail("rope_parameters.compress.rope_type", kind, "only 'default' and 'yarn' are supported")
    if compress.get("attention_factor") != 1.0:
        raise _fail("rope_parameters.compress.attention_factor", compress.get("attention_factor"),
                    "transformers scales cos/sin by it (and derives 0.1·ln(factor) + 1 when absent); only 1.0 "
                    "(mscale off, as V4 is released) is supported")
    max_pos = cfg.get("max_position_embeddings") or V4_DEFAULTS["max_position_embeddings"]
    original = compress.get("original_max_position_embeddings") or max_pos
    factor = compress.get("factor") or max_pos / original
    yarn = YarnScaling(int(original), float(factor), float(compress.get("beta_fast") or 32),
                       float(compress.get("beta_slow") or 1))
    check_yarn_clamps(yarn, float(compress["rope_theta"]), rope_dim)
    return main["rope_theta"], compress["rope_theta"], yarn


def rope_parameters(cfg: Mapping[str, Any]) -> tuple[dict, dict]:
    """transformers' ("main", "compress") rope dicts. A nested {"main", "compress"} dict is used as is (a missing
    rope_theta defaults to the top-level rope_theta in both, as transformers does); a flat one (or the legacy
    `rope_scaling`, which wins) becomes the compressed layers' scaling with compress_rope_theta, the window layers
    getting plain RoPE with rope_theta."""
    theta = cfg.get("rope_theta") or V4_DEFAULTS["rope_theta"]
    rp = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        return ({"rope_theta": theta, **rp["main"]}, {"rope_theta": theta, **rp["compress"]})
    flat = {k: v for k, v in rp.items() if k not in ("main", "compress")}
    compress = {**flat, "rope_theta": cfg.get("compress_rope_theta") or V4_DEFAULTS["compress_rope_theta"]}
    compress.setdefault("rope_type", flat.get("type", "default"))
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    return {"rope_type": "default", "rope_theta": theta}, compress


def check_yarn_clamps(yarn: YarnScaling, base: float, R: int) -> None:
    """transformers clamps YaRN's correction range as max(low, 0), min(high, R - 1); §16.12 clamps both ends to
    [0, R - 1]. They agree unless low > R - 1 or high < 0: refuse those (no real config is near them)."""
    def dim(beta: float) -> float:
        return R * math.log(yarn.original_max_position_embeddings / (beta * 2 * math.pi)) / (2 * math.log(base))
    low, high = math.floor(dim(yarn.beta_fast)), math.ceil(dim(yarn.beta_slow))
    if low > R - 1 or high < 0:
        raise _fail("rope_scaling", yarn, f"YaRN correction range [{low}, {high}] lies outside [0, {R - 1}], where "
                    f"transformers' and the spec's clamps differ")


def quantization_config(cfg: Mapping[str, Any]) -> dict | None:
    """Passed through for the loader; a top-level `expert_dtype` moves into it, as transformers does."""
    quant = cfg.get("quantization_config")
    if not isinstance(quant, Mapping):
        return None
    quant = dict(quant)
    if cfg.get("expert_dtype") is not None:
        quant.setdefault("expert_dtype", cfg["expert_dtype"])
    return quant


__all__ = ["ARCHITECTURE", "V4_DEFAULTS", "attention_types", "deepseek_v4_config", "num_hash_layers",
           "rope_head_dim", "rope_settings"]
