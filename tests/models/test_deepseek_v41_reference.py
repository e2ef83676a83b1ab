"""DeepSeek-V4.1 config and reference forward (deepserve/models/reference/deepseek_v41.py) against the spec's
checkable facts (deepinfer.md §2, §15, §16). Tiny random models; the whole file runs in seconds on 2 cores."""

from __future__ import annotations

import math

import pytest
import torch

from deepserve.models.deepseek_v41_config import DeepseekV41Config, sharing_map
from deepserve.models.engram_hashing import PCG64, engram_compressed_ids, engram_multipliers, engram_table_primes
from deepserve.models.reference.deepseek_v41 import (
    DeepseekV41Reference, Expert, ForwardState, apply_rope, candidate_block_mask, hc_combine, hc_mix, hc_post,
    rope_inv_freq, route, select_topk, sink_attention, sinkhorn)
from deepserve.models.reference.tiny import init_tiny_weights, tiny_config


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.inference_mode():
        yield


def config(variant: str = "mixed", **overrides) -> DeepseekV41Config:
    return DeepseekV41Config.from_hf_dict(tiny_config(variant, **overrides))


def build(variant: str = "mixed", seed: int = 0, dtype=torch.float32, **overrides) -> DeepseekV41Reference:
    return init_tiny_weights(DeepseekV41Reference(config(variant, **overrides), dtype=dtype), seed)


def tokens(T: int, seed: int = 1, V: int = 96) -> torch.Tensor:
    return torch.randint(3, V, (T,), generator=torch.Generator().manual_seed(seed))


def copy_of(model: DeepseekV41Reference, **edits) -> DeepseekV41Reference:
    """A copy of `model` with parameters edited: name=function(tensor) -> new tensor."""
    other = DeepseekV41Reference(model.config)
    sd = model.state_dict()
    for name, fn in edits.items():
        sd[name.replace("__", ".")] = fn(sd[name.replace("__", ".")].clone())
    other.load_state_dict(sd)
    return other


def bump(t: torch.Tensor) -> torch.Tensor:
    return t + torch.randn(t.shape, generator=torch.Generator().manual_seed(7)) * 0.5


def changed(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() > 1e-3


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, atol=1e-5, rtol=0)


V41_FLASH = dict(   # §2.2's orientation geometry ([unverified] there; enough to check roles and shapes)
    num_hidden_layers=40, hidden_size=5120, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64,
    q_lora_rank=1280, o_lora_rank=1024, o_groups=8, sliding_window=128, vocab_size=129280,
    compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0], kv_source_layer_ids=[2, 8, 14, 20],
    index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36], index_n_heads=32, index_head_dim=128, index_topk=512,
    candidate_source_layer_id=20, candidate_block_size=16, candidate_topk_blocks=64, n_routed_experts=384,
    num_experts_per_tok=6, n_shared_experts=1, moe_intermediate_size=2304, swiglu_limit=10.0,
    engram_layer_ids=[1, 14], engram_vocab_size=100000, engram_n_heads=8, engram_head_dim=64,
    num_nextn_predict_layers=3, dspark_n_routed_experts=128, dspark_num_experts_per_tok=3,
    dspark_markov_rank=256, dspark_target_layer_ids=[37, 38, 39], max_position_embeddings=65536,
    rope_scaling=dict(original_max_position_embeddings=65536, factor=16, beta_fast=32, beta_slow=1))


# ================================================================== config: roles (§2.1, §2.2, §16.1-§16.4)


def test_tiny_mixed_roles():
    c = config()
    assert c.layer_types == ("window", "c2", "c2", "c1", "c1", "c1")
    assert c.n_prefill_layer == 3 and c.kv_lora_rank == c.head_dim - c.qk_rope_head_dim
    assert c.kv_map == (0, 1, 1, 3, 3, 3)
    assert c.index_map == (0, 1, 1, 3, 3, 5)
    assert c.index_k_map == (0, 1, 1, 3, 3, 3)                       # defaults to the KV sources
    assert [c.is_kv_source(l) for l in range(6)] == [False, True, False, True, False, False]
    assert [c.is_index_source(l) for l in range(6)] == [False, True, False, True, False, True]
    assert [c.is_index_k_source(l) for l in range(6)] == [False, True, False, True, False, False]
    assert c.candidate_consumers == (5,)
    assert c.num_draft_layers == 1 and c.draft_n_routed_experts == 4 and c.draft_num_experts_per_tok == 1
    assert c.layer_rope_theta(0) == 10000.0 and c.layer_rope_theta(1) == 160000.0
    assert c.layer_yarn(0) is None and c.layer_yarn(3).factor == 4.0


def test_v41_flash_geometry_roles():
    c = config(**V41_FLASH)
    assert c.n_prefill_layer == 20
    assert c.layer_types[:3] == ("window", "window", "c2") and c.layer_types[20] == "c1"
    assert c.kv_map[19] == 14 and c.kv_map[39] == 20 and c.kv_map[1] == 1
    assert c.index_map[27] == 24 and c.index_k_map[27] == 20
    assert c.is_index_source(24) and not c.is_index_k_source(24) and not c.is_kv_source(24)
    assert c.candidate_consumers == (24, 28, 32, 36)


def test_config_defaults_and_overlay():
    raw = tiny_config("c2", compress_rope_theta=None, swiglu_limit=0, hc_shifted=None)
    raw["hidden_size"] = 999                                          # top level: text_config wins (§16.1)
    raw["text_config"]["use_fp4_sparse_kv"] = None                    # JSON null = absent: the default
    c = DeepseekV41Config.from_hf_dict(raw)
    assert c.hidden_size == 32
    assert c.compress_rope_theta == c.rope_theta                      # missing -> rope_theta
    assert c.swiglu_limit is None                                     # falsy -> no clamp
    assert c.hc_shifted is True and c.use_fp4_sparse_kv is True
    assert c.kv_map == c.index_map == c.index_k_map == (0, 1, 2, 3)   # absent lists: every layer its own source
    assert c.n_prefill_layer == 4                                     # no ratio-1 layer -> L (§16.2)
    assert c.yoco_swa_share_hidden is False and c.hc_post_mult_value == 2.0
    no_drafts = config("window", num_nextn_predict_layers=None, compress_ratios=[0, 0, 0])
    assert no_drafts.num_nextn_predict_layers == 0
    assert sharing_map([2, 5], 7) == (0, 1, 2, 2, 2, 5, 5)


BAD_CONFIGS = [
    (dict(compress_ratios=[0, 2, 3, 1, 1, 1, 0]), "compress_ratios[2]=3"),
    (dict(kv_source_layer_ids=[1]), "kv_source_layer_ids=[1]"),                        # crosses n_prefill_layer
    (dict(compress_ratios=[0, 2, 1, 1, 2, 1, 0], kv_source_layer_ids=[2], index_source_layer_ids=[2],
          candidate_source_layer_id=None), "same type"),                             # C2 layer reads a C1 source
    (dict(compress_ratios=[0, 2, 0, 1, 1, 1, 0]), "kv_source_layer_ids=[1, 3]"),        # window after a source
    (dict(index_k_source_layer_ids=[1, 3, 4]), "index_source_layer_ids=[1, 3, 5]"),     # index ⊄ index-K
    (dict(kv_source_layer_ids=[1, 3, 4], index_k_source_layer_ids=[1, 3]), "index_k_source_layer_ids=[1, 3]"),
    (dict(kv_source_layer_ids=[1, 3, 9]), "kv_source_layer_ids=[1, 3, 9]"),
    (dict(hidden_size=None), "hidden_size=None"),
    (dict(compress_ratios=None), "compress_ratios=None"),
    (dict(compress_ratios=[0, 2, 2, 1, 1, 1]), "compress_ratios=[0, 2, 2, 1, 1, 1]"),   # length L + nD
    (dict(hc_eps=None), "hc_eps=None"),
    (dict(hc_sinkhorn_iters=None), "hc_sinkhorn_iters=None"),
    (dict(num_key_value_heads=2), "num_key_value_heads=2"),
    (dict(scoring_func="sigmoid"), "scoring_func='sigmoid'"),
    (dict(norm_topk_prob=False), "norm_topk_prob=False"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(dspark_target_attn_input=False), "dspark_target_attn_input=False"),
    (dict(model_type="deepseek_v4"), "model_type='deepseek_v4'"),
    (dict(architectures=["A", "B"]), "architectures"),
    (dict(dtype="float16"), "dtype='float16'"),
    (dict(o_groups=3), "o_groups=3"),
    (dict(candidate_block_size=17), "candidate_block_size=17"),
    (dict(candidate_topk_blocks=12), "candidate_topk_blocks=12"),
    (dict(candidate_block_size=1, index_topk=9), "candidate_topk_blocks=8"),          # capacity 8 < topk 9
    (dict(candidate_source_layer_id=4), "candidate_source_layer_id=4"),               # not an index source
    (dict(candidate_source_layer_id=1), "candidate_source_layer_id=1"),               # consumers are C1, source C2
    (dict(rope_scaling=dict(original_max_position_embeddings=16, factor=4.0, beta_slow=1)), "rope_scaling.beta_fast"),
    (dict(quantization_config=dict(quant_method="fp8", expert_dtype="fp8", activation_scheme="dynamic",
                                   weight_block_size=[32, 32], scale_fmt="ue8m0")), "quantization_config.expert_dtype"),
    (dict(engram_layer_ids=[0], engram_head_dim=None), "engram_head_dim=None"),
    (dict(engram_layer_ids=[0, 9]), "engram_layer_ids=[0, 9]"),
    (dict(yoco_swa_share_hidden=True), "yoco_swa_share_hidden=True"),
    (dict(num_hash_layers=3), "num_hash_layers=3"),
    (dict(dspark_target_layer_ids=[4, 6]), "dspark_target_layer_ids=[4, 6]"),
]


@pytest.mark.parametrize("overrides,message", BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_config_errors_name_the_field(overrides, message):
    with pytest.raises(ValueError) as err:
        config(**overrides)
    assert message in str(err.value)


def test_valid_quantization_config_accepted():
    q = dict(quant_method="fp8", expert_dtype="fp4", activation_scheme="dynamic", weight_block_size=[32, 32],
             scale_fmt="ue8m0")
    assert config(quantization_config=q).quantization_config == q


# ================================================================== parameters (§2.14, §3, §16.3)


def test_parameter_names_and_shapes_tiny():
    m = build()
    c = m.config
    H, D, nH, G, Lo, Lq, m_, E, I = (c.hidden_size, c.head_dim, c.num_attention_heads, c.o_groups, c.o_lora_rank,
                                     c.q_lora_rank, c.hc_mult, c.n_routed_experts, c.moe_intermediate_size)
    Hi, Di = c.index_n_heads, c.index_head_dim
    shapes = {k: tuple(v.shape) for k, v in m.state_dict().items()}
    want = {
        "embed.weight": (c.vocab_size, H), "head.weight": (c.vocab_size, H), "norm.weight": (H,),
        "layers.0.hc_attn_base": (m_ * (m_ + 2),), "layers.0.hc_attn_fn": (m_ * (m_ + 2), m_ * H),
        "layers.0.hc_ffn_scale": (3,), "layers.0.attn_norm.weight": (H,), "layers.0.ffn_norm.weight": (H,),
        "layers.0.attn.wq_a.weight": (Lq, H), "layers.0.attn.q_norm.weight": (Lq,),
        "layers.0.attn.wq_b.weight": (nH * D, Lq), "layers.0.attn.wkv.weight": (D, H),
        "layers.0.attn.kv_norm.weight": (D,), "layers.0.attn.wo_a.weight": (G * Lo, nH // G * D),
        "layers.0.attn.wo_b.weight": (H, G * Lo), "layers.0.attn.attn_sink": (nH,),
        "layers.1.attn.compressor.wkv.weight": (D, H), "layers.1.attn.compressor.wgate.weight": (D, H),
        "layers.1.attn.compressor.norm.weight": (D,), "layers.3.attn.compressor.wkv.weight": (D, H),
        "layers.1.attn.indexer.wq_b.weight": (Hi * Di, Lq), "layers.1.attn.indexer.weights_proj.weight": (Hi, H),
        "layers.1.attn.indexer.wk.weight": (Di, D), "layers.1.attn.indexer.k_norm.weight": (Di,),
        "layers.5.attn.indexer.wq_b.weight": (Hi * Di, Lq),
        "layers.0.ffn.gate.weight": (E, H), "layers.0.ffn.gate.bias": (E,), "layers.0.ffn.gate.bias_vl": (E,),
        "layers.0.ffn.shared_experts.w1.weight": (I * c.n_shared_experts, H),
        "layers.0.ffn.shared_experts.w2.weight": (H, I * c.n_shared_experts),
        "layers.0.ffn.experts.7.w1.weight": (I, H), "layers.0.ffn.experts.7.w2.weight": (H, I),
        "layers.0.ffn.experts.7.w3.weight": (I, H),
        "mtp.0.main_proj.weight": (H, 2 * H), "mtp.0.main_norm.weight": (H,), "mtp.0.norm.weight": (H,),
        "mtp.0.markov_head.embed.weight": (c.vocab_size, 8), "mtp.0.markov_head.head.weight": (c.vocab_size, 8),
        "mtp.0.confidence_head.proj.weight": (1, H + 8), "mtp.0.ffn.experts.3.w1.weight": (I, H),
        "mtp.0.attn.attn_sink": (nH,), "mtp.0.hc_ffn_fn": (m_ * (m_ + 2), m_ * H),
    }
    for name, shape in want.items():
        assert shapes.get(name) == shape, name
    absent = ("layers.0.attn.compressor", "layers.0.attn.indexer", "layers.2.attn.compressor",
              "layers.2.attn.indexer", "layers.4.attn.compressor", "layers.4.attn.indexer",
              "layers.3.attn.compressor.wgate", "layers.5.attn.compressor", "layers.5.attn.indexer.wk",
              "layers.5.attn.indexer.k_norm", "mtp.0.ffn.experts.4", "mtp.0.attn.compressor", "hc_head", "engram")
    for prefix in absent:
        assert not any(k.startswith(prefix) or f".{prefix}" in k for k in shapes), prefix
    params = dict(m.named_parameters())
    for name in ("layers.0.hc_attn_fn", "layers.1.attn.attn_sink", "layers.0.ffn.gate.bias"):
        assert params[name].dtype == torch.float32
    unshifted = {k: tuple(v.shape) for k, v in DeepseekV41Reference(config("unshifted")).state_dict().items()}
    assert unshifted["hc_head_fn"] == (m_, m_ * H) and unshifted["hc_head_base"] == (m_,)
    assert unshifted["hc_head_scale"] == (1,) and unshifted["mtp.0.hc_head_fn"] == (m_, m_ * H)
    tied = DeepseekV41Reference(config(tie_word_embeddings=True)).state_dict()
    assert "head.weight" not in tied


def test_v41_flash_geometry_shapes_on_meta():
    c = config(**V41_FLASH)
    shapes = {k: tuple(v.shape) for k, v in DeepseekV41Reference(c, torch.bfloat16, device="meta").state_dict().items()}
    assert shapes["layers.0.hc_attn_fn"] == (24, 4 * 5120)
    assert shapes["layers.2.attn.compressor.wgate.weight"] == (512, 5120)
    assert "layers.20.attn.compressor.wgate.weight" not in shapes
    assert "layers.3.attn.compressor.wkv.weight" not in shapes
    assert shapes["layers.24.attn.indexer.wq_b.weight"] == (32 * 128, 1280)
    assert "layers.24.attn.indexer.wk.weight" not in shapes
    assert shapes["layers.20.attn.indexer.wk.weight"] == (128, 512)
    assert shapes["layers.20.attn.wo_a.weight"] == (8 * 1024, 8 * 512)
    assert shapes["layers.39.ffn.experts.383.w2.weight"] == (5120, 2304)
    assert shapes["mtp.0.main_proj.weight"] == (5120, 3 * 5120) and "mtp.0.ffn.experts.128.w1.weight" not in shapes
    assert shapes["mtp.2.confidence_head.proj.weight"] == (1, 5120 + 256)
    rows = sum(p for heads in engram_table_primes(c)[1] for p in heads)
    assert shapes["layers.1.engram.embed.weight"] == (rows, 64)
    assert shapes["layers.14.engram.wkv.weight"] == (5 * 5120, 2 * 8 * 64)
    assert shapes["layers.1.engram.q_weight"] == (4, 5120)


def test_state_dict_roundtrip_and_padded_engram_table():
    m = build("engram")
    ids = tokens(24)
    sd = m.state_dict()
    name = "layers.3.engram.embed.weight"
    sd[name] = torch.cat((sd[name], torch.zeros(256 - sd[name].shape[0] % 256, sd[name].shape[1])))
    other = DeepseekV41Reference(m.config)
    other.load_state_dict(sd, strict=True)
    assert torch.equal(other(ids), m(ids))


# ================================================================== mHC (§2.4, §15.18, §16.5)


def test_sinkhorn_is_doubly_stochastic():
    logits = torch.randn(200, 4, 4, generator=torch.Generator().manual_seed(0))
    C = sinkhorn(logits, 1e-6, 20)
    assert (C > 0).all()
    torch.testing.assert_close(C.sum(-2), torch.ones(200, 4), atol=1e-5, rtol=0)   # the last step normalises columns
    torch.testing.assert_close(C.sum(-1), torch.ones(200, 4), atol=1e-3, rtol=0)
    sharp = sinkhorn(logits * 3, 1e-6, 20)                # approximate (§15.18): fewer iterations than convergence
    assert (sharp.sum(-1) - 1).abs().max() < 0.05 and (sharp.sum(-2) - 1).abs().max() < 1e-5


def test_sinkhorn_steps():
    x = torch.randn(3, 4, 4)
    eps = 1e-3
    C = x.softmax(-1) + eps
    C = C / (C.sum(-2, keepdim=True) + eps)                      # step 1: softmax, then columns
    torch.testing.assert_close(sinkhorn(x, eps, 1), C)
    for _ in range(2):                                           # then rows, columns per extra iteration
        C = C / (C.sum(-1, keepdim=True) + eps)
        C = C / (C.sum(-2, keepdim=True) + eps)
    torch.testing.assert_close(sinkhorn(x, eps, 3), C)


def test_hc_mix_with_zero_fn_is_base():
    c = config()
    m = c.hc_mult
    base = torch.randn(m * (m + 2), generator=torch.Generator().manual_seed(3))
    R = torch.randn(5, m, c.hidden_size)
    pre, post, C = hc_mix(R, torch.zeros(m * (m + 2), m * c.hidden_size), base, torch.tensor([7.0, -2.0, 5.0]), c)
    torch.testing.assert_close(pre, (torch.sigmoid(base[:m]) + c.hc_eps).expand(5, m))
    torch.testing.assert_close(post, (2 * torch.sigmoid(base[m:2 * m])).expand(5, m))
    torch.testing.assert_close(C, sinkhorn(base[2 * m:].view(m, m), c.hc_eps, c.hc_sinkhorn_iters).expand(5, m, m))


def test_hc_post_sums_columns_of_C():
    T, m, H = 3, 4, 5
    R, y = torch.randn(T, m, H), torch.randn(T, H)
    post, C = torch.rand(T, m), torch.rand(T, m, m)
    want = torch.stack([torch.stack([post[t, j] * y[t] + sum(C[t, i, j] * R[t, i] for i in range(m))
                                     for j in range(m)]) for t in range(T)])
    torch.testing.assert_close(hc_post(R, y, post, C), want)


@pytest.mark.parametrize("variant", ["mixed", "engram"])
def test_shifted_hc_chain(variant):
    """§16.5 literally: sublayer s's input is pre(s-1) (from the trunk entering s-1) applied to the trunk
    entering s; the first sublayer uses (1, 0, ...); the final hidden is pre(last) applied to the final trunk."""
    m = build(variant)
    c, ids, trace = m.config, tokens(16), {}
    logits = m(ids, trace=trace)
    L = trace["layers"]

    def pre_of(layer: int, hc: str) -> torch.Tensor:
        b = m.layers[layer]
        return hc_mix(L[layer][f"{hc}_trunk"], getattr(b, f"{hc}_fn"), getattr(b, f"{hc}_base"),
                      getattr(b, f"{hc}_scale"), c)[0]

    first = L[0]["hc_attn_trunk"][:, 0]
    torch.testing.assert_close(L[0]["attn_input"], m.layers[0].attn_norm(first))
    for layer in range(1, c.num_hidden_layers):
        u = hc_combine(L[layer]["hc_attn_trunk"], pre_of(layer - 1, "hc_ffn"))
        torch.testing.assert_close(L[layer]["attn_input"], m.layers[layer].attn_norm(u))
    h = hc_combine(trace["final_trunk"], pre_of(c.num_hidden_layers - 1, "hc_ffn"))
    torch.testing.assert_close(logits, m.norm(h) @ m.head.weight.T, atol=1e-5, rtol=1e-5)
    if variant == "engram":                    # Engram acts on the trunk before the pre-mix: trunk != x0
        assert changed(L[0]["hc_attn_trunk"][:, 1], m.embed.weight[ids])


def pre_part(t: torch.Tensor) -> torch.Tensor:
    t[:4] += torch.tensor([2.0, -1.0, 1.5, -2.0])
    return t


def test_shifted_input_uses_previous_sublayer_pre():
    ids = tokens(12)
    for variant, shifted in (("mixed", True), ("unshifted", False)):
        m = build(variant)
        t0, t1, t2 = {}, {}, {}
        m(ids, trace=t0)
        copy_of(m, layers__1__hc_attn_base=pre_part)(ids, trace=t1)   # layer 1's own attention pre
        copy_of(m, layers__0__hc_ffn_base=pre_part)(ids, trace=t2)    # the sublayer before it
        own, prev = t1["layers"][1]["attn_input"], t2["layers"][1]["attn_input"]
        base = t0["layers"][1]["attn_input"]
        # shifted: sublayer s is fed with the pre of s-1 (whose only use that is); non-shifted: with its own.
        assert same(own, base) == shifted
        if shifted:
            assert changed(prev, base)


def test_unshifted_hc_head_is_used():
    m = build("unshifted")
    ids = tokens(8)
    assert changed(m(ids), copy_of(m, hc_head_base=pre_part)(ids))


# ================================================================== RoPE, YaRN (§2.12, §16.12)


def test_rope_is_interleaved_on_the_last_R_dims_and_invertible():
    c = config()
    inv = rope_inv_freq(c, 0)
    x = torch.randn(6, 3, c.head_dim)
    pos = torch.arange(6) * 5
    y = apply_rope(x, pos, inv)
    R = c.qk_rope_head_dim
    assert torch.equal(y[..., :-R], x[..., :-R])
    z = torch.view_as_complex(x[..., -R:].reshape(6, 3, R // 2, 2).contiguous())
    rot = torch.polar(torch.ones(6, R // 2, dtype=torch.float64), pos[:, None] * inv[None]).to(torch.complex64)
    torch.testing.assert_close(y[..., -R:], torch.view_as_real(z * rot[:, None]).flatten(-2), atol=1e-5, rtol=0)
    torch.testing.assert_close(apply_rope(y, pos, inv, inverse=True), x, atol=1e-5, rtol=0)


def test_yarn_inv_freq():
    c = config()
    R = c.qk_rope_head_dim
    plain = lambda base: base ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)  # noqa: E731
    torch.testing.assert_close(rope_inv_freq(c, 0), plain(10000.0))               # window: base theta, no YaRN
    # R=8, base 160000, L0=16: low = floor(negative) -> 0, high = ceil(0.31) = 1 -> ramp [0, 1, 1, 1].
    e = plain(160000.0)
    torch.testing.assert_close(rope_inv_freq(c, 1), torch.stack((e[0], e[1] / 4, e[2] / 4, e[3] / 4)))
    assert torch.equal(rope_inv_freq(c, None), plain(10000.0))                    # drafts: base rope
    # Both bounds clamped to R-1 (huge L0): ramp all 0 -> no interpolation.
    huge = config(rope_scaling=dict(original_max_position_embeddings=10 ** 15, factor=4.0, beta_fast=32, beta_slow=1))
    torch.testing.assert_close(rope_inv_freq(huge, 1), e)
    m = build()
    assert torch.equal(m.layers[0].attn.inv_freq, plain(10000.0)) and torch.equal(m.layers[4].attn.inv_freq,
                                                                                 rope_inv_freq(c, 4))


def test_window_attention_depends_only_on_relative_positions():
    """Keys RoPE'd at their positions, the output de-RoPE'd at the query position (§2.5): shifting every
    position leaves a window layer's output unchanged; without the de-RoPE it would rotate."""
    m = build()
    attn = m.layers[0].attn
    a = torch.randn(10, m.config.hidden_size)
    pos = torch.arange(10)
    out = attn(a, pos, ForwardState(None))
    torch.testing.assert_close(attn(a, pos + 37, ForwardState(None)), out, atol=1e-4, rtol=1e-4)


# ================================================================== attention reach: causality, window, compression


@pytest.mark.parametrize("variant", ["mixed", "window", "c1", "c2", "shared", "engram", "unshifted"])
def test_causal(variant):
    m = build(variant)
    ids = tokens(24)
    later = ids.clone()
    later[11:] = tokens(13, seed=9)
    a, b = m(ids), m(later)
    assert a.shape == (24, 96) and a.dtype == torch.float32 and torch.isfinite(a).all()
    assert same(a[:11], b[:11]) and changed(a[11:], b[11:])


def change_one(ids: torch.Tensor, position: int) -> torch.Tensor:
    out = ids.clone()
    out[position] = (out[position] + 17) % 93 + 3
    return out


def test_sliding_window_reach():
    m = build("window")                    # 3 window layers, W = 4: a logit sees L·(W-1) = 9 tokens back
    ids, p = tokens(20), 19
    base = m(ids)[p]
    assert changed(m(change_one(ids, p - 9))[p], base)
    assert same(m(change_one(ids, p - 10))[p], base)


def test_engram_extends_reach_by_ngram():
    m = build("window", engram_layer_ids=[0])        # n-grams of M = 3 tokens before layer 0: reach 2 + 9
    ids, p = tokens(20), 19
    base = m(ids)[p]
    assert changed(m(change_one(ids, p - 11))[p], base)
    assert same(m(change_one(ids, p - 12))[p], base)


@pytest.mark.parametrize("variant", ["c1", "c2"])
def test_compressed_kv_reaches_beyond_the_window(variant):
    m = build(variant, sliding_window=2)             # SWA reach 4·1 = 4; compressed entries cover position 0
    ids, p = tokens(12), 11
    assert changed(m(change_one(ids, 0))[p], m(ids)[p])
    w = build("window", sliding_window=2)
    assert same(w(change_one(ids, 0))[p], w(ids)[p])


def test_compression_fires_on_short_prompts():
    m = build("c2")
    ids = tokens(2)                                   # p = 1 completes C2 block 0; p = 0 sees no entry
    other = copy_of(m, layers__1__attn__compressor__wkv__weight=bump)
    a, b = m(ids), other(ids)
    assert same(a[0], b[0]) and changed(a[1], b[1])


@pytest.mark.parametrize("variant,layer,ratio", [("c2", 1, 2), ("c1", 1, 1)])
def test_compressed_entries_positions_and_pooling(variant, layer, ratio):
    """§15.20: entry j has RoPE position j·n; a query at p sees floor((p+1)/n) entries; C2 entry j pools
    tokens 2j, 2j+1 with a per-channel softmax gate; complete blocks only."""
    m = build(variant)
    T, trace = 7, {}
    m(tokens(T), trace=trace)
    t = trace["layers"][layer]
    assert t["visible"].sum(-1).tolist() == [(p + 1) // ratio for p in range(T)]
    comp = m.layers[layer].attn.compressor
    a = t["attn_input"] if variant == "c2" else trace["shared_hidden"]   # C1 layer 1 is the first consumer
    lat = a @ comp.wkv.weight.T
    if ratio == 2:
        gate = (a @ comp.wgate.weight.T)[:6].view(3, 2, -1).softmax(1)
        lat = (gate * lat[:6].view(3, 2, -1)).sum(1)
    pre = torch.nn.functional.rms_norm(lat, (lat.shape[-1],), comp.norm.weight, m.config.rms_norm_eps)
    want = apply_rope(pre, torch.arange(pre.shape[0]) * ratio, rope_inv_freq(m.config, layer))
    assert t["compressed_kv"].shape == (T // ratio, m.config.head_dim)
    torch.testing.assert_close(t["compressed_kv"], want, atol=1e-5, rtol=1e-5)


# ================================================================== sharing maps, YOCO (§2.2, §2.7, §16.7)


def test_sharing_maps_share_kv_index_k_and_topk():
    m = build()
    trace = {}
    m(tokens(40), trace=trace)
    L = trace["layers"]
    assert L[2]["compressed_kv"] is L[1]["compressed_kv"] and torch.equal(L[2]["selected"], L[1]["selected"])
    assert L[4]["compressed_kv"] is L[3]["compressed_kv"] and L[5]["compressed_kv"] is L[3]["compressed_kv"]
    assert torch.equal(L[4]["topk"], L[3]["topk"])
    assert L[5]["index_k"] is L[3]["index_k"]                         # index source reading 3's index K
    assert not torch.equal(L[5]["topk"], L[3]["topk"])                # but its own query and top-k


def test_consumer_kv_sources_compress_the_shared_hidden():
    m = build("shared")                 # consumer half from layer 3; layer 5 is a second consumer KV source
    ids, trace = tokens(30), {}
    m(ids, trace=trace)
    L = trace["layers"]
    assert torch.equal(trace["shared_hidden"], L[3]["attn_input"])
    comp = m.layers[5].attn.compressor
    want = apply_rope(comp(trace["shared_hidden"]), torch.arange(30), rope_inv_freq(m.config, 5))
    torch.testing.assert_close(L[5]["compressed_kv"], want)
    assert changed(L[5]["compressed_kv"], apply_rope(comp(L[5]["attn_input"]), torch.arange(30),
                                                     rope_inv_freq(m.config, 5)))
    # The consumer half's global KV depends only on producer-half output (and layer 3's pre-mix + norm1).
    edits = {f"layers__{l}__{p}": bump for l in (3, 4) for p in ("attn__wq_a__weight", "attn__wkv__weight",
                                                                 "ffn__experts__0__w2__weight", "hc_ffn_fn")}
    t2 = {}
    copy_of(m, **edits)(ids, trace=t2)
    assert torch.equal(t2["layers"][5]["compressed_kv"], L[5]["compressed_kv"])
    assert changed(t2["layers"][5]["attn_input"], L[5]["attn_input"])
    t3 = {}
    copy_of(m, layers__2__attn__wkv__weight=bump)(ids, trace=t3)
    assert changed(t3["layers"][5]["compressed_kv"], L[5]["compressed_kv"])


# ================================================================== indexer, top-k, candidate blocks (§2.6, §16.8-10)


def test_select_topk_rule():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0], [5.0, 1.0, 0.0, 0.0, 0.0]])
    allowed = torch.tensor([[True, True, True, True, False], [False, True, True, False, False]])
    idx, mask = select_topk(scores, allowed, 3)
    assert idx.tolist() == [[1, 2, 3], [1, 2, -1]]                    # ties -> lower index; missing -> -1
    assert mask.tolist() == [[False, True, True, True, False], [False, True, True, False, False]]
    idx, _ = select_topk(scores[:, :2], allowed[:, :2], 4)
    assert idx.tolist() == [[1, 0, -1, -1], [1, -1, -1, -1]]


def test_indexer_logits_and_topk_match_the_formula():
    m = build()
    c, T, trace = m.config, 40, {}
    m(tokens(T), trace=trace)
    t, attn = trace["layers"][1], m.layers[1].attn
    a, inv = t["attn_input"], rope_inv_freq(c, 1)
    qn = attn.q_norm(attn.wq_a(a))
    qi = apply_rope((qn @ attn.indexer.wq_b.weight.T).view(T, c.index_n_heads, -1), torch.arange(T), inv)
    pre = attn.compressor(a)
    ki = apply_rope(attn.indexer.k_norm(pre @ attn.indexer.wk.weight.T), torch.arange(pre.shape[0]) * 2, inv)
    w = a @ attn.indexer.weights_proj.weight.T
    logits = torch.einsum("th,thj->tj", w, torch.einsum("thd,jd->thj", qi, ki).relu())
    torch.testing.assert_close(t["index_logits"], logits, atol=1e-4, rtol=1e-4)
    for p in range(T):
        n = (p + 1) // 2
        want = sorted(range(n), key=lambda j: (-t["index_logits"][p, j].item(), j))[:c.index_topk]
        got = [j for j in t["topk"][p].tolist() if j >= 0]
        assert got == want


def test_candidate_block_mask_rule():
    logits = torch.tensor([[0.0, 9.0, 1.0, 1.0, 5.0, 0.0, 7.0]])
    visible = torch.tensor([[True, True, True, True, True, True, False]])
    kept = candidate_block_mask(logits, visible, block_size=2, topk_blocks=2)
    # blocks: [0,9] -> 9, [1,1] -> 1, [5,0] -> 5, [7 invisible] -> never
    assert kept.tolist() == [[True, True, False, False, True, True, False]]
    kept = candidate_block_mask(logits, visible, block_size=2, topk_blocks=8)
    assert kept.tolist() == [[True, True, True, True, True, True, False]]


def test_candidate_consumer_topk_lies_in_the_source_blocks():
    m = build()
    trace = {}
    m(tokens(40), trace=trace)
    L = trace["layers"]
    cand, sel5 = L[3]["candidates"], L[5]["selected"]
    assert not (sel5 & ~cand).any()
    assert (cand.sum(-1) <= 2 * 8).all() and (~cand[-1]).any()       # 20 blocks, 8 kept: restriction bites
    free, _ = select_topk(L[5]["index_logits"], L[5]["visible"], 3)
    assert not torch.equal(free, L[5]["topk"])                        # differs from an unrestricted top-k
    src, _ = select_topk(L[3]["index_logits"], L[3]["visible"], 3)
    assert torch.equal(src, L[3]["topk"])                             # the source's own top-k is unrestricted


def test_sparse_with_topk_covering_everything_equals_dense():
    ids = tokens(40)
    sparse = build(index_topk=64, candidate_block_size=8, candidate_topk_blocks=8)
    dense = DeepseekV41Reference(config(index_topk=0, candidate_source_layer_id=None))
    missing, unexpected = dense.load_state_dict(sparse.state_dict(), strict=False)
    assert not missing and unexpected and all(".indexer." in k for k in unexpected)
    torch.testing.assert_close(sparse(ids), dense(ids), atol=1e-5, rtol=1e-5)
    narrow = DeepseekV41Reference(config())
    narrow.load_state_dict(sparse.state_dict())
    assert changed(narrow(ids), dense(ids))


# ================================================================== attention sink, grouped output (§2.5)


def test_attention_sink_joins_the_denominator_only():
    q = torch.randn(3, 2, 8)
    kv = torch.randn(5, 8)
    mask = torch.ones(3, 5, dtype=torch.bool).tril()
    sink = torch.tensor([0.5, -1.0])
    s = torch.einsum("thd,sd->ths", q, kv) / math.sqrt(8)
    s = s.masked_fill(~mask[:, None], float("-inf"))
    p = s.exp() / (s.exp().sum(-1, keepdim=True) + sink.exp()[None, :, None])
    torch.testing.assert_close(sink_attention(q, kv, mask, sink, 8), torch.einsum("ths,sd->thd", p, kv))
    plain = torch.einsum("ths,sd->thd", s.softmax(-1), kv)
    torch.testing.assert_close(sink_attention(q, kv, mask, torch.full((2,), -1e4), 8), plain)


def test_grouped_output_projection_groups_heads_contiguously():
    m = build()
    c, attn = m.config, m.layers[0].attn
    o = torch.randn(4, c.num_attention_heads, c.head_dim)
    per = c.num_attention_heads // c.o_groups
    wv = attn.wo_a.weight.view(c.o_groups, c.o_lora_rank, per * c.head_dim)
    want = torch.cat([o[:, g * per:(g + 1) * per].reshape(4, -1) @ wv[g].T for g in range(c.o_groups)], dim=-1)
    torch.testing.assert_close(attn.grouped_wv(o), want)


# ================================================================== MoE (§2.8, §15.17, §16.11)


def test_router_rule():
    E, k = 6, 2
    gate = torch.eye(E, 4).repeat(1, 1)
    x = torch.tensor([[3.0, 1.0, 0.5, -2.0], [30.0, 30.0, 0.0, 0.0]])
    bias = torch.tensor([0.0, 0.0, 2.0, 0.0, 0.0, 0.0])
    experts, w = route(x, gate, bias, k, 1.5)
    s = torch.nn.functional.softplus(x @ gate.T).sqrt()
    assert experts[0].tolist() == [2, 0]                              # chosen by biased scores
    torch.testing.assert_close(w[0], s[0, [2, 0]] / s[0, [2, 0]].sum() * 1.5)   # weighted by unbiased ones
    torch.testing.assert_close(w.sum(-1), torch.full((2,), 1.5))
    assert experts[1].tolist() == [0, 1]                              # sqrt(30) = 5.48 beats 2 + 0.83; tie -> 0
    torch.testing.assert_close(s[1, 0], torch.tensor(math.sqrt(30.0)))   # softplus(x) = x above 20
    tie_e, _ = route(torch.zeros(1, 4), gate, torch.zeros(E), 3, 1.0)
    assert tie_e.tolist() == [[0, 1, 2]]                              # exact ties -> lower expert id


def test_swiglu_clamp():
    e = Expert(4, 3, 2.0, torch.float32)
    for p in e.parameters():
        p.copy_(torch.randn(p.shape) * 10)
    x = torch.randn(5, 4) * 10
    g, u = x @ e.w1.weight.T, x @ e.w3.weight.T
    want = (torch.nn.functional.silu(g.clamp(max=2.0)) * u.clamp(-2.0, 2.0)) @ e.w2.weight.T
    torch.testing.assert_close(e(x), want)
    e.limit = None
    torch.testing.assert_close(e(x), (torch.nn.functional.silu(g) * u) @ e.w2.weight.T)


def test_moe_layer_matches_the_routing_formula():
    m = build()
    ffn = m.layers[1].ffn
    x = torch.randn(9, m.config.hidden_size)
    experts, w = route(x, ffn.gate.weight, ffn.gate.bias, 2, 1.5)
    want = ffn.shared_experts(x)
    for t in range(9):
        for j in range(2):
            want[t] += w[t, j] * ffn.experts[experts[t, j]](x[t:t + 1])[0]
    torch.testing.assert_close(ffn(x), want, atol=1e-5, rtol=1e-5)


# ================================================================== Engram (§2.9, §15.19)


def test_engram_primes_and_multipliers():
    c = config("engram")
    primes = engram_table_primes(c)
    flat = [p for layer in primes.values() for heads in layer for p in heads]
    assert len(flat) == len(set(flat)) == 2 * 2 * 2 and min(flat) >= c.engram_vocab_size
    assert primes[0][0][0] == 53 and primes[0][0][1] == 59 and primes[0][1][0] == 61   # next primes after 49
    for layer in c.engram_layer_ids:
        u = engram_multipliers(c, layer)
        assert len(u) == c.engram_max_ngram_size and all(v % 2 == 1 for v in u)


def test_pcg64_matches_numpy_default_rng():
    np = pytest.importorskip("numpy")
    for seed in (0, 10007, 30021, 2 ** 70 + 5):
        for high in ((2 ** 63 - 1) // 96 // 2, (2 ** 63 - 1) // 129280 // 2, 2 ** 40 + 1):
            want = np.random.default_rng(seed).integers(0, high, size=4, dtype=np.int64).tolist()
            assert PCG64(seed).integers(high, 4) == want


def test_engram_hash_rows():
    m = build("engram")
    eng = m.layers[3].engram
    cids = torch.tensor([5, 9, 13, 2, 77])
    rows = eng.hash_indices(cids, pad=2)
    u, P, off = eng.multipliers, eng.primes, eng.offsets
    for p in range(5):
        toks = [cids[p - r].item() if p - r >= 0 else 2 for r in range(3)]
        for n in (2, 3):
            h = 0
            for r in range(n):
                h ^= toks[r] * u[r]
            for head in range(2):
                i = (n - 2) * 2 + head
                assert rows[p, i].item() == h % P[i] + off[i]


def test_engram_gate_formula():
    m = build("engram")
    c, eng = m.config, m.layers[3].engram
    T, mm, H = 6, c.hc_mult, c.hidden_size
    R = torch.randn(T, mm, H)
    cids = tokens(T)
    e = eng.embed.weight[eng.hash_indices(cids, 2)].flatten(1)
    kv = (e @ eng.wkv.weight.T).view(T, mm + 1, H)
    norm = lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)  # noqa: E731
    d = (norm(R) * eng.q_weight * norm(kv[:, :mm]) * eng.k_weight).sum(-1) / math.sqrt(H)
    g = torch.sigmoid(torch.sign(d) * d.abs().clamp(min=1e-6).sqrt())
    torch.testing.assert_close(eng(R, cids, 2), R + g[..., None] * kv[:, mm, None, :])


def test_engram_off_uses_no_engram_parameters():
    on = build("engram")
    ids = tokens(24)
    off = DeepseekV41Reference(config())
    missing, unexpected = off.load_state_dict(on.state_dict(), strict=False)
    assert not missing and unexpected and all(".engram." in k for k in unexpected)
    assert not any("engram" in k for k in off.state_dict())
    assert changed(on(ids), off(ids))
    silent = copy_of(on, layers__0__engram__wkv__weight=torch.zeros_like,
                     layers__3__engram__wkv__weight=torch.zeros_like)
    torch.testing.assert_close(silent(ids), off(ids), atol=1e-5, rtol=1e-5)   # v = 0: engram adds nothing


def test_engram_compressed_vocabulary():
    decoded = ["Hello", " hello", "héllo", "\n\n", " ", "a\ufffd", "b\ufffd", "ＡＢ", "", "x  y"]
    raw = ["Hello", "Ġhello", "héllo", "ĊĊ", "Ġ", "<0xE2>", "<0xE3>", "ＡＢ", "<pad>", "x  y"]
    ids = engram_compressed_ids(decoded, raw)
    assert ids[0] == ids[1] == ids[2] == 0                # case, accents, surrounding space
    assert ids[3] == ids[4] == 1                          # whitespace runs -> a lone, preserved space
    assert ids[5] != ids[6]                               # U+FFFD: raw token strings as keys
    assert ids == [0, 0, 0, 1, 1, 2, 3, 4, 5, 6]          # dense, first-seen order; "ＡＢ" -> "ab" (NFKC)
    c = config("engram", engram_compressed_vocab_size=40)
    m = DeepseekV41Reference(c)
    with pytest.raises(RuntimeError):
        m(tokens(4))
    with pytest.raises(ValueError):
        m.set_engram_vocab(list(range(96)))                # ids must lie in [0, 40)
    m.set_engram_vocab([i % 40 for i in range(96)])


# ================================================================== determinism, dtype


def test_determinism():
    ids = tokens(32)
    a, b = build(seed=3), build(seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    first = a(ids)
    assert torch.equal(first, a(ids)) and torch.equal(first, b(ids))
    assert changed(build(seed=4)(ids), first)


def test_bfloat16_forward_tracks_float32():
    ids = tokens(16)
    f32 = build("engram")
    bf16 = DeepseekV41Reference(f32.config, dtype=torch.bfloat16)
    bf16.load_state_dict(f32.state_dict())
    assert bf16.layers[0].hc_attn_fn.dtype == torch.float32 and bf16.embed.weight.dtype == torch.bfloat16
    lo, hi = bf16(ids), f32(ids)
    assert lo.dtype == torch.float32 and torch.isfinite(lo).all()
    assert torch.corrcoef(torch.stack((lo.flatten(), hi.flatten())))[0, 1] > 0.95
