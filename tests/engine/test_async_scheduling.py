"""Overlapped scheduling (step n+1 scheduled and launched before step n's tokens reach the host) gives exactly
the tokens of the plain loop. On the CPU the launch finishes before it returns, but the bookkeeping (in-flight
tokens, inputs read from the previous step, results dropped for sequences that finished meanwhile) is the same
code the GPU runs."""

from __future__ import annotations

import pytest

from deepserve import LLM, SamplingParams


def _workload():
    prompts = [{"prompt_token_ids": [(11 * i + 3 * j) % 200 + 5 for j in range(3 + 5 * i)]} for i in range(12)]
    params = []
    for i in range(12):
        kw = dict(max_tokens=6 + 3 * i, seed=100 + i)
        if i % 3 == 0:
            kw.update(temperature=0.0)
        elif i % 3 == 1:
            kw.update(temperature=0.9, top_p=0.8)
        else:
            kw.update(temperature=0.7, top_k=20, stop_token_ids=[57, 91])    # may stop early
        if i == 4:
            kw.update(repetition_penalty=1.3, frequency_penalty=0.2)        # forces a wait for in-flight tokens
        if i == 5:
            kw.update(min_tokens=4, logprobs=2)
        params.append(SamplingParams(**kw))
    return prompts, params


def _run(model: str, **engine_args):
    llm = LLM(model, skip_tokenizer_init=True, seed=0, **engine_args)
    prompts, params = _workload()
    outs = llm.generate(prompts, params, use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    tokens = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
    logprobs = [[{t: lp.logprob for t, lp in entry.items()} for entry in o.outputs[0].logprobs or []] for o in outs]
    return (tokens, logprobs), llm


def _assert_same(got, want):
    """Same tokens and finish reasons; logprobs equal up to float rounding (the two loops batch steps
    differently, and a GEMM's rounding may depend on its number of rows)."""
    assert got[0] == want[0]
    for a, b in zip(got[1], want[1]):
        assert len(a) == len(b)
        for ea, eb in zip(a, b):
            assert ea.keys() == eb.keys()
            assert all(abs(ea[t] - eb[t]) < 1e-4 for t in ea)


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 16, "max_num_seqs": 5},                 # chunked prefill mixed with decodes
    {"kv_cache_memory_bytes": 24 * 1024 * 4, "block_size": 4},          # preemption while tokens are in flight
], ids=["plain", "chunked", "preemption"])
def test_overlapped_equals_plain_loop(tiny_llama, engine_args):
    want, _ = _run(tiny_llama, async_scheduling=False, **engine_args)
    got, llm = _run(tiny_llama, async_scheduling=True, **engine_args)
    assert llm.engine.async_scheduling
    _assert_same(got, want)
    if "kv_cache_memory_bytes" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0


def test_overlapped_with_prefix_cache_hits(tiny_llama):
    shared = list(range(10, 50))
    prompts = [{"prompt_token_ids": shared + [60 + i, 61 + i]} for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    results = []
    for overlap in (False, True):
        llm = LLM(tiny_llama, skip_tokenizer_init=True, async_scheduling=overlap)
        first = llm.generate(prompts[:1], params, use_tqdm=False)
        rest = llm.generate(prompts[1:], params, use_tqdm=False)
        assert all(o.num_cached_tokens >= 32 for o in rest)
        results.append([o.outputs[0].token_ids for o in first + rest])
    assert results[0] == results[1]


def test_abort_with_a_step_in_flight_frees_everything(tiny_llama):
    llm = LLM(tiny_llama, skip_tokenizer_init=True, async_scheduling=True)
    engine = llm.engine
    for i in range(4):
        engine.add_request(str(i), {"prompt_token_ids": list(range(5, 20 + i))},
                           SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine._inflight is not None
    engine.abort_request(["0", "2"])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert sorted(finished) == ["1", "3"]
    assert all(len(o.outputs[0].token_ids) == 50 for o in finished.values())
    engine.step()     # drains the last launched step
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
