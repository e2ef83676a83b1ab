"""DeepSeek-V4's compressors (layers/compressor_v4.py) and hash router (layers/hash_router.py) against transformers.

Tiny random DeepseekV4ForCausalLM models of several layer-type mixes run their full (no-cache) forward, the
reference (docs/deepseek_v4.md: where transformers' cached generation could differ, its full forward is what we
match). Hooks take each compressed layer's attention input and the entries transformers computes from it (pre-RoPE
at the compressor's / indexer's kv_norm, post-RoPE where the attention and the index scorer read them); our modules,
loaded from the same weights under their released names, compress the same input. transformers' compress_rates
are configurable, so small ratios make both compressors fire on short prompts; one mix keeps the released 4 / 128.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from deepserve.kernels.reference.moe import RoutingConfig  # noqa: E402
from deepserve.layers.compressor_v4 import (CSACompressor, HCACompressor, compress_sequence,  # noqa: E402
                                            entry_rope_position, indexer_key_compressor, span_positions)
from deepserve.layers.hash_router import HashRouter, hash_routing_config  # noqa: E402
from deepserve.layers.moe import Router  # noqa: E402
from deepserve.models.deepseek_v4_config import deepseek_v4_config  # noqa: E402
from deepserve.models.deepseek_v41_config import CSA, HCA  # noqa: E402
from deepserve.models.reference.deepseek_v41 import apply_rope, rope_inv_freq  # noqa: E402
from deepserve.tools.make_tiny_checkpoint import (deepseek_v4_layer_mix_config, deepseek_v4_released_name,  # noqa: E402
                                                 randomize_deepseek_v4)

W, C, H_ = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
YARN = dict(type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32, beta_slow=1)
# name -> (layer_types, compress_rates, extra config, prompt length)
MIXES = {
    "window_csa4_hca8_yarn": ([W, C, H_, C], {C: 4, H_: 8}, dict(rope_scaling=YARN), 37),
    "hca4_csa2_window": ([H_, C, W], {C: 2, H_: 4}, {}, 23),
    "released_rates_4_128": ([C, H_], {C: 4, H_: 128}, {}, 261),
}


hf_config = deepseek_v4_layer_mix_config
randomize = randomize_deepseek_v4


def run_hf(mix: str, seed: int = 0):
    """(HF model, our config, input ids, captured tensors per layer) of one full no-cache forward."""
    types, rates, extra, T = MIXES[mix]
    torch.manual_seed(seed)
    model = randomize(transformers.DeepseekV4ForCausalLM(hf_config(types, rates, **extra)).eval(), seed)
    ids = torch.randint(3, 96, (1, T), generator=torch.Generator().manual_seed(seed + 1))
    seen: dict[int, dict[str, torch.Tensor]] = {}
    hooks = []

    def keep(layer, key, value) -> None:                  # hooks must return None not to replace anything
        seen.setdefault(layer, {})[key] = value.detach()

    def keep_gate(layer, args, out) -> None:
        keep(layer, "gate_x", args[0][0])
        keep(layer, "gate_w", out[1])
        keep(layer, "gate_ids", out[2])

    for l, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        hooks.append(attn.register_forward_pre_hook(lambda m, a, l=l: keep(l, "x", a[0][0])))
        hooks.append(layer.mlp.gate.register_forward_hook(lambda m, a, out, l=l: keep_gate(l, a, out)))
        if attn.compressor is None:
            continue
        comp = attn.compressor
        hooks.append(comp.kv_norm.register_forward_hook(lambda m, a, out, l=l: keep(l, "kv_pre", out[0])))
        hooks.append(comp.register_forward_hook(lambda m, a, out, l=l: keep(l, "kv_post", out[0][0, 0])))
        if hasattr(comp, "indexer"):
            hooks.append(comp.indexer.kv_norm.register_forward_hook(lambda m, a, out, l=l: keep(l, "ik_pre", out[0])))
            hooks.append(comp.indexer.scorer.register_forward_pre_hook(
                lambda m, a, l=l: keep(l, "ik_post", a[1][0])))
    with torch.no_grad():
        model(ids, use_cache=False)
    for h in hooks:
        h.remove()
    return model, deepseek_v4_config(model.config.to_dict()), ids[0], seen


def released_state(model, prefix: str) -> dict[str, torch.Tensor]:
    """transformers' weights under their released names, those below `prefix`, relative to it."""
    out = {}
    for name, t in [*model.state_dict().items()]:
        rel = deepseek_v4_released_name(name)
        if rel.startswith(prefix):
            out[rel[len(prefix):]] = t
    return out


def ours(model, config, layer: int, indexer: bool = False):
    """Our compressor of `layer` (or its indexer's key compressor), loaded strictly from the released names."""
    c, r = config, config.compress_ratio(layer)
    if indexer:
        module, prefix = indexer_key_compressor(r, c.hidden_size, c.index_head_dim, c.rms_norm_eps), "indexer."
    elif c.layer_types[layer] == CSA:
        module, prefix = CSACompressor(r, c.hidden_size, c.head_dim, c.rms_norm_eps), ""
    else:
        module, prefix = HCACompressor(r, c.hidden_size, c.head_dim, c.rms_norm_eps), ""
    module.load_state_dict(released_state(model, f"layers.{layer}.attn.{prefix}compressor."), strict=True)
    return module


def compressed_layers(config):
    return [l for l in range(config.num_hidden_layers) if config.is_compressed(l)]


# ================================================================== compressors


@pytest.mark.parametrize("mix", list(MIXES))
def test_entries_match_transformers(mix):
    model, config, _, seen = run_hf(mix)
    checked = set()
    for l in compressed_layers(config):
        targets = [(False, "kv")] + ([(True, "ik")] if config.layer_types[l] == CSA else [])
        for indexer, key in targets:
            module = ours(model, config, l, indexer)
            with torch.no_grad():
                pre = compress_sequence(module, seen[l]["x"])
            want = seen[l][f"{key}_pre"]
            assert pre.shape == want.shape and pre.shape[0] == seen[l]["x"].shape[0] // module.ratio > 0
            torch.testing.assert_close(pre, want, atol=1e-5, rtol=1e-5)
            # RoPE at entry_rope_position with the layer's compress theta / YaRN (our config) = what attention
            # and the index scorer read.
            pos = entry_rope_position(torch.arange(pre.shape[0]), module.ratio)
            post = apply_rope(pre, pos, rope_inv_freq(config, l))
            torch.testing.assert_close(post, seen[l][f"{key}_post"], atol=1e-5, rtol=1e-5)
            checked.add((config.layer_types[l], key))
    assert {(CSA, "kv"), (CSA, "ik"), (HCA, "kv")} <= checked          # every compressor kind fired


def test_interface_attributes():
    csa, hca = CSACompressor(4, 32, 16, 1e-6), HCACompressor(8, 32, 16, 1e-6)
    assert (csa.ratio, csa.span, csa.state_width, csa.head_dim) == (4, 8, 4 * 16, 16)
    assert (hca.ratio, hca.span, hca.state_width, hca.head_dim) == (8, 8, 2 * 16, 16)
    assert set(csa.state_dict()) == {"wkv.weight", "wgate.weight", "ape", "norm.weight"}
    assert csa.wkv.weight.shape == (32, 32) and csa.ape.shape == (4, 32) and hca.ape.shape == (8, 16)
    assert span_positions(torch.tensor([0, 2]), 4, 8).tolist() == [[-4, -3, -2, -1, 0, 1, 2, 3],
                                                                     [4, 5, 6, 7, 8, 9, 10, 11]]
    assert entry_rope_position(3, 128) == 384


def test_token_state_is_per_token_so_chunks_and_decode_agree():
    """The paged state is written chunk by chunk (prefill chunks, then one token per decode step): a token's state
    must not depend on its neighbours, and pooling entries from states written in pieces gives the same entries."""
    model, config, _, seen = run_hf("window_csa4_hca8_yarn")
    l = next(l for l in compressed_layers(config) if config.layer_types[l] == CSA)
    module, x = ours(model, config, l), seen[l]["x"]
    with torch.no_grad():
        whole = module.token_state(x)
        pieces = torch.cat([module.token_state(x[a:b]) for a, b in ((0, 5), (5, 6), (6, 19), (19, x.shape[0]))])
        torch.testing.assert_close(pieces, whole, atol=1e-6, rtol=1e-6)
        j = torch.tensor([3, 0, 5])                                             # any entries, any order
        pos = span_positions(j, module.ratio, module.span)
        entries = module.pool(pieces[pos.clamp(min=0)], pos >= 0, j)
    torch.testing.assert_close(entries, seen[l]["kv_pre"][j], atol=1e-5, rtol=1e-5)


def test_comparison_has_teeth():
    """What the test compares is sensitive to the details: a span shifted by one token, a dropped position bias,
    a CSA read without its previous window, all miss transformers' entries by far more than the tolerance."""
    model, config, _, seen = run_hf("window_csa4_hca8_yarn")
    for l in compressed_layers(config):
        module, x, want = ours(model, config, l), seen[l]["x"], seen[l]["kv_pre"]
        states = module.token_state(x).detach()
        j = torch.arange(1, want.shape[0])                                      # entries whose span is all valid
        pos = span_positions(j, module.ratio, module.span)
        ones = torch.ones_like(pos, dtype=torch.bool)
        with torch.no_grad():
            assert (module.pool(states[pos - 1], ones, j) - want[j]).abs().max() > 1e-2
            module.ape.zero_()
            assert (module.pool(states[pos], ones, j) - want[j]).abs().max() > 1e-2
        if module.overlap:
            first_window_missing = ones.clone()
            first_window_missing[:, :module.ratio] = False
            module.load_state_dict(released_state(model, f"layers.{l}.attn.compressor."))
            with torch.no_grad():
                assert (module.pool(states[pos], first_window_missing, j) - want[j]).abs().max() > 1e-2


# ================================================================== routers


def test_hash_router_matches_transformers():
    model, config, ids, seen = run_hf("window_csa4_hca8_yarn")
    hashed = [l for l in range(config.num_hidden_layers) if config.is_hash_moe(l)]
    assert hashed == [0]
    c = config
    router = HashRouter(c.hidden_size, c.n_routed_experts, c.vocab_size,
                        hash_routing_config(c.num_experts_per_tok, c.routed_scaling_factor, c.scoring_func))
    router.load_state_dict(released_state(model, "layers.0.ffn.gate."), strict=True)
    router.check_table()
    load = torch.zeros(c.n_routed_experts, dtype=torch.int64)
    with torch.no_grad():
        weights, experts = router(seen[0]["gate_x"], ids, load)
    assert torch.equal(experts, seen[0]["gate_ids"])                         # the table decides, per token id
    assert torch.equal(experts, model.model.layers[0].mlp.gate.tid2eid[ids])
    torch.testing.assert_close(weights, seen[0]["gate_w"], atol=1e-6, rtol=1e-6)
    assert torch.equal(load, torch.bincount(experts.flatten(), minlength=c.n_routed_experts))
    torch.testing.assert_close(weights.sum(-1), torch.full((ids.numel(),), c.routed_scaling_factor))
    # Another token id row routes elsewhere: the ids really come from input_ids.
    other = router(seen[0]["gate_x"], (ids + 1) % c.vocab_size)[1]
    assert not torch.equal(other, experts)


def test_hash_router_rejects_a_bad_table():
    router = HashRouter(8, 4, 10, hash_routing_config(2, 1.0))
    router.tid2eid[7, 1] = 4
    with pytest.raises(ValueError, match=r"tid2eid\[7\]"):
        router.check_table()


def test_topk_router_of_the_other_layers_is_the_existing_router():
    """Non-hash V4 layers: transformers' DeepseekV4TopKRouter = deepserve's Router with sqrt(softplus) scores,
    noaux_tc (bias-steered choice, unbiased weights), renormalised, scaled. transformers' topk is unsorted, so
    the chosen sets are compared sorted."""
    model, config, _, seen = run_hf("window_csa4_hca8_yarn")
    c = config
    cfg = RoutingConfig(top_k=c.num_experts_per_tok, scoring=c.scoring_func, topk_method=c.topk_method,
                        renormalize=c.norm_topk_prob, scaling_factor=c.routed_scaling_factor)
    for l in range(1, c.num_hidden_layers):
        router = Router(c.hidden_size, c.n_routed_experts, cfg)
        state = released_state(model, f"layers.{l}.ffn.gate.")
        router.load_state_dict({"weight": state["weight"], "e_score_correction_bias": state["bias"]}, strict=True)
        with torch.no_grad():
            weights, experts = router(seen[l]["gate_x"])
        hf_ids, order = seen[l]["gate_ids"].sort(dim=-1)
        ids, mine = experts.sort(dim=-1)
        assert torch.equal(ids, hf_ids)
        torch.testing.assert_close(weights.gather(1, mine), seen[l]["gate_w"].gather(1, order), atol=1e-6,
                                   rtol=1e-6)
