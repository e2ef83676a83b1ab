"""The same requests give the same tokens alone, batched, chunked, preempted and with prefix-cache hits."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM, SamplingParams

ENGINE = dict(skip_tokenizer_init=True, dtype="float32", block_size=8, seed=0)


def mixed_requests(num: int = 16, seed: int = 3):
    """16 prompts of mixed lengths sharing a few prefixes; half greedy, half seeded sampling."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 512, (40,), generator=gen).tolist()
    prompts, params = [], []
    for i in range(num):
        length = int(torch.randint(3, 90, (1,), generator=gen))
        own = torch.randint(0, 512, (length,), generator=gen).tolist()
        ids = shared[: 8 * (i % 4) + 5] + own if i % 2 else own
        prompts.append({"prompt_token_ids": ids})
        if i % 2:
            params.append(SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1000 + i, max_tokens=24,
                                         ignore_eos=True))
    return prompts, params


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Each request run alone, no prefix cache."""
    prompts, params = mixed_requests()
    llm = LLM(tiny_llama, **ENGINE, enable_prefix_caching=False)
    return [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]


def run_batch(path, **overrides):
    prompts, params = mixed_requests()
    llm = LLM(path, **{**ENGINE, **overrides})
    outs = llm.generate(prompts, params, use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked after all requests finished"
    return llm, tokens(outs)


def test_batch_of_16_equals_alone(tiny_llama, reference):
    _, got = run_batch(tiny_llama)
    assert got == reference


def test_chunked_prefill_on_and_off(tiny_llama, reference):
    llm, got = run_batch(tiny_llama, enable_chunked_prefill=True, max_num_batched_tokens=32)
    assert got == reference
    _, got = run_batch(tiny_llama, enable_chunked_prefill=False, enable_prefix_caching=False)
    assert got == reference


def test_preemption_under_tiny_kv_budget(tiny_llama, reference):
    # 2 layers x 2 (k, v) x 2 heads x 16 dims x 4 bytes = 512 B per token; 24 blocks of 8 tokens.
    llm, got = run_batch(tiny_llama, kv_cache_memory_bytes=24 * 8 * 512)
    assert llm.engine.scheduler.num_preemptions > 0, "the budget was meant to force preemption"
    assert got == reference


def test_prefix_cache_hits(tiny_llama, reference):
    llm, got = run_batch(tiny_llama, max_num_seqs=2)   # later requests find earlier prefixes cached
    assert got == reference
    assert llm.engine.block_manager.prefix_hits > 0
    prompts, params = mixed_requests()
    again = llm.generate(prompts, params, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in again)
    assert tokens(again) == reference
