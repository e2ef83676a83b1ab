"""The offline API on the real default model: text, stop strings, n, logprobs, chat."""

from __future__ import annotations

import math

import pytest

from deepserve import LLM, SamplingParams


def test_chat_answers_sensibly(smollm):
    out = smollm.chat([{"role": "user", "content": "What is the capital of France?"}],
                      SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"          # ended at EOS (<|im_end|>), not by length
    assert "<|im_end|>" not in out.outputs[0].text          # special tokens skipped


def test_text_equals_decode_of_tokens(smollm):
    out = smollm.generate("Write a list of three fruits:", SamplingParams(temperature=0.8, seed=3, max_tokens=40),
                          use_tqdm=False)[0]
    tok = smollm.get_tokenizer()
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)
    assert len(out.outputs[0].token_ids) <= 40
    assert out.prompt_token_ids == tok.encode("Write a list of three fruits:")


def test_stop_string_is_matched_on_text_and_removed(smollm):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = smollm.generate("1, 2, 3, 4,", params, use_tqdm=False)[0].outputs[0].text
    assert " 7" in full, full
    stopped = smollm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=40, stop=[" 7"]),
                              use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == " 7"
    assert stopped.text == full[: full.index(" 7")]
    kept = smollm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=40, stop=[" 7"],
                                                         include_stop_str_in_output=True),
                           use_tqdm=False)[0].outputs[0]
    assert kept.text == full[: full.index(" 7") + 2]


def test_stop_token_ids_and_min_tokens(smollm):
    tok = smollm.get_tokenizer()
    comma = tok.encode(",", add_special_tokens=False)[0]
    out = smollm.generate("1, 2, 3, 4", SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[comma]),
                          use_tqdm=False)[0].outputs[0]
    assert out.token_ids[-1] == comma and out.stop_reason == comma and out.finish_reason == "stop"
    later = smollm.generate("1, 2, 3, 4", SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[comma],
                                                         min_tokens=5), use_tqdm=False)[0].outputs[0]
    assert len(later.token_ids) >= 5 and comma not in later.token_ids[:4]


def test_n_and_seed(smollm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16)
    a = smollm.generate("Once upon a time", params, use_tqdm=False)[0]
    b = smollm.generate("Once upon a time", params, use_tqdm=False)[0]
    assert [o.index for o in a.outputs] == [0, 1, 2]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]   # seeded: reproducible
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1                        # children differ


def test_logprobs_and_prompt_logprobs(smollm):
    out = smollm.generate("The sky is", SamplingParams(temperature=0, max_tokens=5, logprobs=3, prompt_logprobs=2),
                          use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 5
    for tok, entry in zip(c.token_ids, c.logprobs):
        assert tok in entry and entry[tok].rank == 1        # greedy: the chosen token is the most likely
        assert 3 <= len(entry) <= 4 and all(lp.logprob <= 0 for lp in entry.values())
    assert math.isclose(c.cumulative_logprob, sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)),
                        rel_tol=1e-6)
    n = len(out.prompt_token_ids)
    assert len(out.prompt_logprobs) == n and out.prompt_logprobs[0] is None
    for pos in range(1, n):
        assert out.prompt_token_ids[pos] in out.prompt_logprobs[pos]


def test_sampling_params_list_and_ordering(smollm):
    outs = smollm.generate(["Hello", "Goodbye", "Why"],
                           [SamplingParams(max_tokens=k, ignore_eos=True, temperature=0) for k in (1, 2, 3)],
                           use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3]
    assert [o.prompt for o in outs] == ["Hello", "Goodbye", "Why"]
    with pytest.raises(ValueError, match="sampling_params"):
        smollm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)


def test_reset_prefix_cache_forgets_cached_prompts(tiny_llama):
    llm = LLM(tiny_llama, skip_tokenizer_init=True)
    prompt = {"prompt_token_ids": list(range(3, 40))}
    params = SamplingParams(temperature=0, max_tokens=2)
    llm.generate(prompt, params, use_tqdm=False)
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 32
    llm.reset_prefix_cache()
    assert llm.generate(prompt, params, use_tqdm=False)[0].num_cached_tokens == 0
