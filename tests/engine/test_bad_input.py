"""Bad input gets a clear error; the engine keeps serving everyone else and leaks nothing."""

from __future__ import annotations

import pytest

from deepserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", block_size=8, max_model_len=128)


def all_blocks_free(llm) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": list(range(200))}, "max_model_len"),
    ({"prompt_token_ids": [1, 2, 512]}, "outside the vocabulary"),
    ({"prompt_token_ids": [1, -3]}, "outside the vocabulary"),
    ({"nothing": 1}, "prompt_token_ids"),
    ("text without a tokenizer", "skip_tokenizer_init"),
])
def test_bad_prompt_is_a_clear_error_while_others_are_served(llm, prompt, message):
    engine = llm.engine
    engine.add_request("good", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", prompt, SamplingParams(max_tokens=4))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"]
    assert len(finished[0].outputs[0].token_ids) == 8
    assert all_blocks_free(llm)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_k=-5), "top_k"),
    (dict(n=0), "n"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_generate_with_one_bad_prompt_adds_nothing(llm):
    with pytest.raises(ValueError, match="prompt 1"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": []}], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert all_blocks_free(llm)
    out = llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_abort_frees_blocks(llm):
    engine = llm.engine
    for i in range(4):
        engine.add_request(f"a{i}", {"prompt_token_ids": list(range(1, 40))}, SamplingParams(max_tokens=50))
    engine.step()
    engine.step()
    assert not all_blocks_free(llm)
    engine.abort_request([f"a{i}" for i in range(4)])
    assert not engine.has_unfinished_requests()
    assert all_blocks_free(llm)


def test_unknown_engine_argument_is_an_error(tiny_llama):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(tiny_llama, max_num_seq=3)


def test_request_that_can_never_fit_finishes_with_reason(tiny_llama):
    # 4 blocks of 8 tokens: a 40-token prompt can never be held.
    small = LLM(tiny_llama, skip_tokenizer_init=True, block_size=8, kv_cache_memory_bytes=4 * 8 * 512)
    outs = small.generate([{"prompt_token_ids": list(range(1, 41))}, {"prompt_token_ids": [1, 2, 3]}],
                          SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "length" and "KV blocks" in outs[0].error
    assert outs[0].outputs[0].token_ids == []
    assert len(outs[1].outputs[0].token_ids) == 4
