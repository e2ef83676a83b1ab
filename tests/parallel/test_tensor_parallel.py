"""Tensor parallelism as a post-load sharding pass (`model.shard_tensor_parallel(tp)`), on gloo CPU processes.

Every rank builds the same tiny model (the same seeded weights), runs a prefill of two prompts and one decode step
unsharded (the reference), shards it over the TP group and runs the same steps again: the logits must agree in
float32. All cases of one world size run in one `run_ranks` call (spawning processes is the slow part); each case's
outcome is checked by its own test.
"""

from __future__ import annotations

import pytest
import torch

from deepserve.layers.rank_group import RankGroup
from tests.parallel.gloo_harness import make_groups, run_ranks

BLOCK, NUM_BLOCKS = 4, 16
PROMPTS = [[3, 17, 99, 5, 42], [7, 1, 250, 33, 8, 91, 120, 64, 2, 200, 11]]
NEXT = [19, 77]

DENSE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0)
MLA = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
           max_position_embeddings=128, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
           num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1, kv_lora_rank=32,
           qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0)

CONFIGS = {
    "llama": dict(DENSE, architectures=["LlamaForCausalLM"], model_type="llama"),
    "llama_int8": dict(DENSE, architectures=["LlamaForCausalLM"], model_type="llama"),
    "qwen2": dict(DENSE, architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(DENSE, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=32),
    "mixtral": dict(DENSE, architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=4,
                    num_experts_per_tok=2),
    "qwen3_moe": dict(DENSE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0], norm_topk_prob=True),
    "qwen3_moe_whole_experts": dict(DENSE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    mlp_only_layers=[0], norm_topk_prob=True),
    "deepseek_v2": dict(MLA, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", q_lora_rank=None,
                        topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5),
    "deepseek_v3": dict(MLA, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", q_lora_rank=48,
                        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                        num_nextn_predict_layers=1),
    "deepseek_v3_whole_experts": dict(MLA, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                                      q_lora_rank=48, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                      norm_topk_prob=True),
}
WHOLE_EXPERTS = {"qwen3_moe_whole_experts", "deepseek_v3_whole_experts"}
WITH_MTP = {"deepseek_v3"}


# --- what every rank runs ------------------------------------------------------------------------

def build(cfg: dict, keep_mtp: bool = False):
    """The model through the loader (random weights), re-drawn from one seed so that logits are far from uniform
    and every rank holds the same full weights."""
    from deepserve.config import ModelConfig
    from deepserve.worker.model_loader import load_model

    config = ModelConfig(model="dummy", hf_config=cfg, dtype=torch.float32, max_model_len=64, load_format="dummy",
                         skip_tokenizer_init=True, seed=0, keep_mtp=keep_mtp)
    model = load_model(config, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() >= 2:
                p.copy_(noise * 1.5 / p.shape[-1] ** 0.5)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)
    return model


def _batch(tokens: list[list[int]], starts: list[int]):
    """A ForwardBatch of each sequence's `tokens` at positions starts[i]..; sequence i owns blocks 4i.. 4i+3."""
    from deepserve.layers.attention import TorchPagedAttention
    from deepserve.layers.forward_batch import ForwardBatch

    ids, positions, slots, qsl = [], [], [], [0]
    for i, (toks, start) in enumerate(zip(tokens, starts)):
        for j, t in enumerate(toks):
            pos = start + j
            ids.append(t)
            positions.append(pos)
            slots.append((4 * i + pos // BLOCK) * BLOCK + pos % BLOCK)
        qsl.append(qsl[-1] + len(toks))
    seq_lens = [s + len(t) for t, s in zip(tokens, starts)]
    tables = torch.tensor([[4 * i + b for b in range(4)] for i in range(len(tokens))])
    batch = ForwardBatch(input_ids=torch.tensor(ids), positions=torch.tensor(positions),
                         slot_mapping=torch.tensor(slots), block_tables=tables, query_start_loc=torch.tensor(qsl),
                         seq_lens=torch.tensor(seq_lens), query_lens_cpu=[len(t) for t in tokens],
                         seq_lens_cpu=seq_lens, logits_indices=torch.arange(len(ids)), block_size=BLOCK)
    batch.attn_metadata = TorchPagedAttention().build_metadata(batch)
    return batch


def run_steps(model) -> dict[str, torch.Tensor]:
    """Logits of a prefill of PROMPTS and of one decode step after it, over fresh KV caches (and the MTP
    layer's logits over the prefill rows, when the model keeps one)."""
    for attn in model.attention_layers():
        attn.kv_cache = torch.zeros(attn.kv_cache_shape(NUM_BLOCKS, BLOCK))
    out = {}
    with torch.inference_mode():
        batch = _batch(PROMPTS, [0, 0])
        hidden = model(batch)
        out["prefill"] = model.compute_logits(hidden)
        if getattr(model, "mtp", None) is not None:
            out["mtp"] = model.mtp_step(batch.input_ids.roll(-1), hidden, batch)[0]
        out["decode"] = model.compute_logits(model(_batch([[t] for t in NEXT], [len(p) for p in PROMPTS])))
    return out


class ExpertsOfThisRank:
    """Stands in for expert parallelism where the routed experts stay whole (shard_experts=False): this rank
    computes only its experts' share (expert e on rank e % size), plus the shared experts' partial sum; the layer's
    all-reduce then adds the ranks' shares."""

    def __init__(self, rank: int, size: int) -> None:
        from deepserve.layers.moe import TorchMoE
        self.rank, self.size, self.inner = rank, size, TorchMoE()

    def forward(self, x, w13, w2, topk_weights, topk_ids, swiglu_limit=None, shared_out=None, shared_experts=None):
        mine = (topk_ids % self.size == self.rank).to(topk_weights.dtype)
        return self.inner.forward(x, w13, w2, topk_weights * mine, topk_ids, swiglu_limit, shared_out, shared_experts)


def _shapes(model) -> dict:
    """What the sharded model holds, for the checks in the parent."""
    layer = model.layers[-1]
    attn = layer.self_attn
    info = {"attn_heads": attn.attn.num_heads, "fuses_norms": [lay.fuses_norms for lay in model.layers],
            "kv_cache_shape": tuple(attn.attn.kv_cache_shape(NUM_BLOCKS, BLOCK)),
            "embed": tuple(model.embed_tokens.weight.shape)}
    if hasattr(attn, "qkv_proj"):
        info.update(qkv=tuple(attn.qkv_proj.weight.shape), o_proj=tuple(attn.o_proj.weight.shape),
                    kv_heads=attn.attn.num_kv_heads)
    else:
        q = attn.q_b_proj if attn.q_lora_rank else attn.q_proj
        info.update(q=tuple(q.weight.shape), kv_b=tuple(attn.kv_b_proj.weight.shape),
                    kv_a=tuple(attn.kv_a_proj_with_mqa.weight.shape), o_proj=tuple(attn.o_proj.weight.shape))
    mlp = layer.mlp
    if hasattr(mlp, "expert_load"):
        info.update(w13=tuple(mlp.w13.shape), w2=tuple(mlp.w2.shape), moe_tp=mlp.tp.size,
                    inter=mlp.intermediate_size)
        if mlp.shared_experts is not None:
            info.update(shared_gate_up=tuple(mlp.shared_experts.gate_up_proj.weight.shape),
                        shared_tp=mlp.shared_experts.tp.size)
    dense = model.layers[0].mlp
    if not hasattr(dense, "expert_load"):
        info.update(dense_gate_up=tuple(dense.gate_up_proj.weight.shape),
                    dense_down=tuple(dense.down_proj.weight.shape), dense_tp=dense.tp.size)
    # The narrowed tensors own exactly their elements: the full ones were freed, not viewed.
    info["owns_storage"] = all(p.untyped_storage().nbytes() == p.numel() * p.element_size()
                               for p in model.parameters())
    if getattr(model, "mtp", None) is not None:
        info["mtp_o_proj"] = tuple(model.mtp.block.self_attn.o_proj.weight.shape)
    return info


def _case(name: str, tp: RankGroup) -> dict:
    from deepserve.layers.quantization import quantize_model

    model = build(CONFIGS[name], keep_mtp=name in WITH_MTP)
    whole = name in WHOLE_EXPERTS
    if name.endswith("int8"):
        quantized_ref = run_steps(quantize_model(build(CONFIGS[name]), "int8"))
    ref = run_steps(model)
    model.shard_tensor_parallel(tp, shard_experts=not whole)
    if whole:
        for moe in model.moe_layers():
            moe.backend = ExpertsOfThisRank(tp.rank, tp.size)
    info = _shapes(model)
    if name.endswith("int8"):
        quantize_model(model, "int8")
        ref = quantized_ref
    out = run_steps(model)
    return {"ref": ref, "out": out, "info": info}


def rank_cases(rank: int, world: int, names: list[str]) -> dict:
    tp = make_groups(rank, world, tp=world).tp
    results = {}
    for name in names:
        try:
            results[name] = _case(name, tp)
        except Exception:               # noqa: BLE001 - reported per case by its test
            import traceback
            results[name] = {"error": traceback.format_exc()}
    return results


# --- the tests -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tp2():
    return run_ranks(rank_cases, 2, sorted(CONFIGS), timeout=240)


@pytest.fixture(scope="module")
def tp4():
    return run_ranks(rank_cases, 4, ["llama", "deepseek_v3"], timeout=240)


def _result(results: list[dict], name: str) -> list[dict]:
    per_rank = [r[name] for r in results]
    for rank, r in enumerate(per_rank):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
    return per_rank


def _assert_logits_match(per_rank: list[dict], rtol: float = 1e-5) -> None:
    for r in per_rank:
        assert r["ref"].keys() == r["out"].keys()
        for key, ref in r["ref"].items():
            err = (r["out"][key] - ref).abs().max().item()
            scale = ref.abs().max().item()
            assert err <= rtol * max(scale, 1.0), f"{key}: max abs error {err:.3e} (logit scale {scale:.3e})"
    # Every rank samples from the same full-vocabulary logits.
    for r in per_rank[1:]:
        for key in r["out"]:
            assert torch.equal(r["out"][key], per_rank[0]["out"][key])
            assert r["out"][key].shape[-1] == 256


def test_llama_kv_heads_split(tp2):
    per_rank = _result(tp2, "llama")
    _assert_logits_match(per_rank)
    info = per_rank[1]["info"]
    # 4 query heads, 2 kv heads of 16 dims over 2 ranks: 2 q heads and 1 kv head each.
    assert info["qkv"] == ((2 + 2 * 1) * 16, 64) and info["o_proj"] == (64, 32)
    assert info["attn_heads"] == 2 and info["kv_heads"] == 1 and info["kv_cache_shape"][3] == 1
    assert info["dense_gate_up"] == (128, 64) and info["dense_down"] == (64, 64) and info["dense_tp"] == 2
    assert info["fuses_norms"] == [False, False] and info["embed"] == (256, 64) and info["owns_storage"]


def test_llama_kv_heads_replicated_over_4_ranks(tp4):
    per_rank = _result(tp4, "llama")
    _assert_logits_match(per_rank)
    for r in per_rank:
        info = r["info"]
        assert info["attn_heads"] == 1 and info["kv_heads"] == 1 and info["qkv"] == (3 * 16, 64)
        assert info["dense_gate_up"] == (64, 64) and info["dense_down"] == (64, 32)


def test_qwen2_qkv_bias_and_tied_embedding(tp2):
    per_rank = _result(tp2, "qwen2")
    _assert_logits_match(per_rank)
    assert per_rank[0]["info"]["qkv"] == (64, 64)


def test_qwen3_qk_norm(tp2):
    per_rank = _result(tp2, "qwen3")
    _assert_logits_match(per_rank)
    # head_dim 32 (not hidden / heads): 2 q heads + 2 x 1 kv head of 32 per rank; o_proj reads 2 x 32.
    assert per_rank[0]["info"]["qkv"] == (4 * 32, 64) and per_rank[0]["info"]["o_proj"] == (64, 64)


def test_int8_quantizes_the_sharded_model(tp2):
    # Row-parallel weights get per-shard scales, so the match with the unsharded int8 model is loose.
    _assert_logits_match(_result(tp2, "llama_int8"), rtol=5e-2)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_moe_experts_sharded(tp2, name):
    per_rank = _result(tp2, name)
    _assert_logits_match(per_rank)
    info = per_rank[0]["info"]
    inter = 128 if name == "mixtral" else 32
    assert info["w13"] == (4, inter, 64) and info["w2"] == (4, 64, inter // 2) and info["inter"] == inter // 2
    assert info["moe_tp"] == 2
    if name == "qwen3_moe":         # layer 0 is dense (mlp_only_layers)
        assert info["dense_gate_up"] == (128, 64) and info["dense_tp"] == 2


def test_qwen3_moe_whole_experts(tp2):
    per_rank = _result(tp2, "qwen3_moe_whole_experts")
    _assert_logits_match(per_rank)
    info = per_rank[0]["info"]
    assert info["w13"] == (4, 64, 64) and info["w2"] == (4, 64, 32) and info["moe_tp"] == 2
    assert info["qkv"] == (64, 64)


def test_deepseek_v3_mla_moe_shared_dense_and_mtp(tp2):
    per_rank = _result(tp2, "deepseek_v3")
    _assert_logits_match(per_rank)
    info = per_rank[1]["info"]
    # 4 heads over 2 ranks: q_b_proj 2 x (16 + 8) rows, kv_b_proj 2 x (16 + 16), o_proj 2 x 16 columns.
    assert info["q"] == (48, 48) and info["kv_b"] == (64, 32) and info["o_proj"] == (64, 32)
    assert info["kv_a"] == (32 + 8, 64) and info["kv_cache_shape"] == (NUM_BLOCKS, BLOCK, 40)
    assert info["attn_heads"] == 2
    assert info["w13"] == (8, 32, 64) and info["w2"] == (8, 64, 16) and info["moe_tp"] == 2
    assert info["shared_gate_up"] == (64, 64) and info["shared_tp"] == 1    # reduced by the MoE's own all-reduce
    assert info["dense_gate_up"] == (128, 64) and info["dense_tp"] == 2
    assert info["mtp_o_proj"] == (64, 32) and "mtp" in per_rank[0]["out"]
    assert info["owns_storage"]


def test_deepseek_v3_over_4_ranks(tp4):
    per_rank = _result(tp4, "deepseek_v3")
    _assert_logits_match(per_rank)
    assert per_rank[3]["info"]["attn_heads"] == 1 and per_rank[3]["info"]["w2"] == (8, 64, 8)


def test_deepseek_v2_q_proj(tp2):
    per_rank = _result(tp2, "deepseek_v2")
    _assert_logits_match(per_rank)
    assert per_rank[0]["info"]["q"] == (48, 64)


def test_deepseek_v3_whole_experts(tp2):
    per_rank = _result(tp2, "deepseek_v3_whole_experts")
    _assert_logits_match(per_rank)
    info = per_rank[0]["info"]
    assert info["w13"] == (8, 64, 64) and info["w2"] == (8, 64, 32)
    assert info["shared_gate_up"] == (64, 64) and info["moe_tp"] == 2 and info["kv_b"] == (64, 32)


# --- errors: no collective runs, so a group of one process stands in for a larger one -------------

def _fake_group(size: int, rank: int = 0) -> RankGroup:
    return RankGroup(rank=rank, size=size, group=object(), ranks=tuple(range(size)))


def test_heads_not_divisible():
    model = build(CONFIGS["llama"])
    with pytest.raises(ValueError, match="num_attention_heads = 4 .* 3"):
        model.shard_tensor_parallel(_fake_group(3))


def test_kv_heads_neither_divide():
    model = build(dict(CONFIGS["llama"], num_attention_heads=12, num_key_value_heads=6, head_dim=16))
    with pytest.raises(ValueError, match="num_key_value_heads = 6"):
        model.shard_tensor_parallel(_fake_group(4))


def test_intermediate_size_not_divisible():
    model = build(dict(CONFIGS["llama"], intermediate_size=130))
    with pytest.raises(ValueError, match="intermediate_size = 130"):
        model.shard_tensor_parallel(_fake_group(4))


def test_mla_heads_not_divisible():
    model = build(dict(CONFIGS["deepseek_v2"], num_hidden_layers=1))
    with pytest.raises(ValueError, match="num_attention_heads = 4"):
        model.shard_tensor_parallel(_fake_group(8))


def test_one_rank_is_a_no_op():
    model = build(CONFIGS["llama"])
    before = {n: p.clone() for n, p in model.named_parameters()}
    fuses = [layer.fuses_norms for layer in model.layers]
    model.shard_tensor_parallel(RankGroup())
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert [layer.fuses_norms for layer in model.layers] == fuses
