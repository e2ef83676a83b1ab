"""Mixtral and Qwen3-MoE against HF transformers: logits, greedy tokens, mixed batches, dummy weights."""

from __future__ import annotations

import pytest
import torch
from hf_compare import check_alone, check_mixed_batch, load_hf, random_prompt, save_tiny

from deepserve import LLM, SamplingParams
from deepserve.layers.moe import FusedMoE

COMMON = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256)


def _mixtral(path):
    import transformers

    cfg = transformers.MixtralConfig(**COMMON, num_hidden_layers=2, intermediate_size=128, num_local_experts=8,
                                     num_experts_per_tok=2)
    return save_tiny(path, cfg, transformers.MixtralForCausalLM)


def _qwen3_moe(path):
    import transformers

    # Layer 1 stays dense (mlp_only_layers); weights not renormalised over the top-k (norm_topk_prob=False).
    cfg = transformers.Qwen3MoeConfig(**COMMON, num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32,
                                      num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1],
                                      norm_topk_prob=False)
    return save_tiny(path, cfg, transformers.Qwen3MoeForCausalLM)


# name -> (writer, KV bytes per token in fp32: layers x 2 (k, v) x kv heads x head dim x 4)
MODELS = {"mixtral": (_mixtral, 2 * 2 * 2 * 16 * 4), "qwen3_moe": (_qwen3_moe, 3 * 2 * 2 * 16 * 4)}


@pytest.fixture(scope="module", params=sorted(MODELS))
def tiny_moe(request, tmp_path_factory):
    writer, kv_bytes = MODELS[request.param]
    path = writer(tmp_path_factory.mktemp(request.param))
    return path, load_hf(path), kv_bytes


def test_logits_and_greedy_match_hf(tiny_moe):
    path, hf, _ = tiny_moe
    llm = check_alone(path, hf)
    moe = llm.engine.runner.model.moe_layers()
    assert moe and all(isinstance(m, FusedMoE) for m in moe)


def test_mixed_batch_matches_hf(tiny_moe):
    path, hf, kv_bytes = tiny_moe
    check_mixed_batch(path, hf, kv_bytes)


def test_expert_load_counts_routed_tokens(tiny_moe):
    path, _, _ = tiny_moe
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", block_size=8)
    model = llm.engine.runner.model
    for layer in model.moe_layers():
        layer.reset_expert_load()
    ids = random_prompt(20, seed=5)
    llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    # 20 prompt tokens in one step, then 3 decode steps (the 4th token needs no forward): 23 tokens x top-2.
    for layer in model.moe_layers():
        assert layer.expert_load.sum().item() == 23 * 2
        assert layer.expert_load.dtype == torch.int64


def test_dummy_weights_run(tiny_moe):
    path, _, _ = tiny_moe
    llm = LLM(path, skip_tokenizer_init=True, dtype="float32", load_format="dummy", block_size=8)
    out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
