"""Speculative decoding on a CUDA GPU: a decode verifying drafts replays the decode CUDA graph of its row count (one
decode row per position), and greedy tokens equal decoding without drafts; also with MLA (tiny DeepSeek-V2),
whose latent cache the draft rows write before attending; and with DeepSeek-V3's MTP drafter (k = 1 and 3), which
runs eagerly after each replayed decode step from the final hidden states the graph kept."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM, SamplingParams
from tests.spec_decode.mtp_checkpoint import bigram_mtp, write_tiny_v3_mtp
from tests.spec_decode.draft_recording import recording as recorded_drafts

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def repetitive_prompts(n: int) -> list[dict]:
    out = []
    for i in range(n):
        phrase = [(11 * i + 7 * j) % 200 + 3 for j in range(7)]
        out.append({"prompt_token_ids": [(5 * i + j) % 250 + 3 for j in range(9 + i)] + phrase * 3})
    return out


@pytest.mark.parametrize("eager", [False, True])
def test_greedy_with_drafts_equals_plain_decoding_in_graphs_and_eagerly(tiny_llama, eager):
    prompts = repetitive_prompts(6)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, device="cuda", dtype="float32", kv_cache_memory_bytes=1 << 26,
              enforce_eager=eager)
    plain = LLM(tiny_llama, **kw)
    spec = LLM(tiny_llama, speculative_config=NGRAM, **kw)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    replays = spec.engine.runner.cuda_graphs.num_replays if not eager else 0
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    stats = spec.engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    if not eager:
        assert spec.engine.runner.cuda_graphs.num_replays - replays > 10
    bm = spec.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_confidence_policy_on_the_gpu_uses_a_graph_cost_curve(tiny_llama):
    spec = LLM(tiny_llama, skip_tokenizer_init=True, device="cuda", dtype="float32", kv_cache_memory_bytes=1 << 26,
               speculative_config={**NGRAM, "verify_length": "confidence"})
    model = spec.engine.speculator.cost_model
    assert model.padded and model.sizes == spec.engine.runner.cuda_graphs.sizes
    prompts = repetitive_prompts(4)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = LLM(tiny_llama, skip_tokenizer_init=True, device="cuda", dtype="float32", kv_cache_memory_bytes=1 << 26)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == want


def test_mla_draft_rows_in_graphs(tmp_path):
    """Tiny DeepSeek-V3 (latent cache, Triton MLA decode in the graphs): drafts verified as decode rows give the
    tokens of plain decoding."""
    import transformers
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=256, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_group=4, topk_group=2, q_lora_rank=48, routed_scaling_factor=2.5)
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    model.save_pretrained(str(tmp_path))
    kw = dict(skip_tokenizer_init=True, device="cuda", dtype="float32", kv_cache_memory_bytes=1 << 26)
    prompts = repetitive_prompts(5)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(tmp_path), **kw).generate(prompts, params, use_tqdm=False)]
    spec = LLM(str(tmp_path), speculative_config=NGRAM, **kw)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params, use_tqdm=False)] == want
    assert spec.engine.get_stats().spec_decode_num_accepted_tokens > 0


MTP_VOCAB = 48          # <= hidden_size (64): bigram_mtp needs it


@pytest.fixture(scope="module")
def tiny_v3_mtp(tmp_path_factory) -> str:
    """Tiny DeepSeek-V3 (2 layers, MLA + MoE) with one MTP layer (tests/spec_decode/mtp_checkpoint.py)."""
    path = str(tmp_path_factory.mktemp("v3_mtp_gpu"))
    write_tiny_v3_mtp(path, vocab_size=MTP_VOCAB)
    return path


def mtp_prompts(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    return [{"prompt_token_ids": torch.randint(3, MTP_VOCAB, (7 + 5 * i,), generator=g).tolist()} for i in range(n)]


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafts_from_the_hidden_states_of_replayed_graphs(tiny_v3_mtp, k):
    """The MTP layer made a bigram table of the plain output (so drafts are accepted; its hidden-state half stays
    random, so the confidences read the target's hidden states). With CUDA graphs on, decode steps replay graphs that
    also keep every row's final hidden state and the MTP layer drafts from them: greedy tokens equal decoding without
    speculation and speculation with enforce_eager, and the drafts (confidences included) equal the eager engine's."""
    prompts = mtp_prompts(5)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, device="cuda", dtype="float32", kv_cache_memory_bytes=1 << 26, max_num_seqs=8)
    want = [o.outputs[0].token_ids for o in LLM(tiny_v3_mtp, **kw).generate(prompts, params, use_tqdm=False)]
    drafts = {}
    for eager in (True, False):
        llm = LLM(tiny_v3_mtp, speculative_config={"method": "mtp", "num_speculative_tokens": k},
                  enforce_eager=eager, **kw)
        bigram_mtp(llm.engine.runner.model, [p["prompt_token_ids"][-1:] + w for p, w in zip(prompts, want)])
        graphs = llm.engine.runner.cuda_graphs
        if eager:
            assert graphs is None
        else:
            assert graphs is not None and graphs.keep_hidden, "MTP speculation was meant to keep the decode graphs"
            replays = graphs.num_replays
        drafts[eager] = recorded_drafts(llm)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
        if not eager:
            assert graphs.num_replays - replays > 10, "decode steps were meant to replay the graphs"
        assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        del llm
    assert max(len(d[2]) for d in drafts[False]) == k
    assert [d[:3] for d in drafts[False]] == [d[:3] for d in drafts[True]]
    for g, e in zip(drafts[False], drafts[True]):
        assert g[3] == pytest.approx(e[3], abs=5e-3)
