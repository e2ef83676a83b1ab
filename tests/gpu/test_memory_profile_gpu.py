"""On a CUDA GPU, what start-up accepts must run (issue 20): an engine whose KV cache takes all the memory the profile
leaves runs a step of the largest size its config allows (every row's prompt logprobs, and the costliest sampling)
without running out of memory; a setting whose largest step cannot fit is refused at start-up
with a value that fits, and that value then runs the issue's workload."""

from __future__ import annotations

import gc
import json
import random
import re

import pytest
import torch

from deepserve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.gpu_alone,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# A large vocabulary makes the logits the biggest buffer of a large step, as in Llama 3.
SMALL = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=1024, vocab_size=128256, head_dim=64, tie_word_embeddings=True)
LLAMA_3_2_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                    intermediate_size=8192, vocab_size=128256, head_dim=64, tie_word_embeddings=True)


def write_config(path, shape: dict) -> str:
    # No eos id: random weights must never stop early.
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", max_position_embeddings=8192,
               rms_norm_eps=1e-5, rope_theta=500000.0, torch_dtype="bfloat16", hidden_act="silu",
               bos_token_id=None, eos_token_id=None, pad_token_id=None, **shape)
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def start(model: str, **kwargs) -> LLM:
    return LLM(model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", **kwargs)


def record_steps(llm: LLM) -> list[tuple[int, int]]:
    """(tokens, sequences) of every step the engine's scheduler forms from now on."""
    steps = []
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def recording():
        out = schedule()
        steps.append((out.num_batched_tokens, len(out.scheduled)))
        return out

    scheduler.schedule = recording
    return steps


def prompts(count: int, length: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)        # distinct prompts: no prefix-cache hit shrinks a step
    return [{"prompt_token_ids": [rng.randrange(100, 128000) for _ in range(length)]} for _ in range(count)]


def costly(max_tokens: int) -> SamplingParams:
    """The costliest request: every prompt row's logits (prompt logprobs), penalties, top-k/top-p/min-p, logprobs."""
    return SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                          presence_penalty=0.5, frequency_penalty=0.5, logprobs=20, prompt_logprobs=20,
                          max_tokens=max_tokens, ignore_eos=True)


def release() -> None:
    """Give a dropped engine's memory back before the next one profiles (a refused start-up leaves its weights to
    the garbage collector)."""
    gc.collect()
    torch.cuda.empty_cache()


def test_largest_step_runs_with_the_kv_cache_filling_the_rest(tmp_path):
    model = write_config(tmp_path, SMALL)
    llm = start(model, max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=65536, gpu_memory_utilization=0.9)
    runner = llm.engine.runner
    kv_bytes = sum(c.numel() * c.element_size() for c in runner.kv_caches)
    _, total = torch.cuda.mem_get_info()
    assert kv_bytes + runner.profiled_peak_bytes > 0.7 * total      # the cache took the memory the profile left
    steps = record_steps(llm)
    outs = llm.generate(prompts(64, 1024), costly(2), use_tqdm=False)
    assert max(steps) == (65536, 64)          # one step of max_num_batched_tokens over max_num_seqs sequences
    assert all(len(o.outputs[0].token_ids) == 2 for o in outs)
    assert all(len(o.prompt_logprobs) == 1024 for o in outs)
    del llm
    release()


def test_a_dropped_engine_in_a_reference_cycle_leaves_the_next_its_memory(tmp_path):
    """`del llm` frees nothing while the handle sits in a reference cycle: its weights and KV cache stay allocated
    until the garbage collector runs. The next engine collects before it measures what the process holds, so it
    gets the cache the first one had, not what the first one's leftovers leave of its share (60% of the GPU twice
    does not fit)."""
    model = write_config(tmp_path, SMALL)
    args = dict(max_model_len=2048, max_num_seqs=16, gpu_memory_utilization=0.6)
    first = start(model, **args)
    first_kv = sum(c.numel() * c.element_size() for c in first.engine.runner.kv_caches)
    cycle = [first]
    cycle.append(cycle)
    del first, cycle
    second = start(model, **args)
    second_kv = sum(c.numel() * c.element_size() for c in second.engine.runner.kv_caches)
    assert abs(second_kv - first_kv) <= 0.02 * first_kv, (second_kv, first_kv)
    del second
    release()


def test_issue_20_setting_runs_or_is_refused_with_a_value_that_runs(tmp_path):
    """The issue's setting (270000 tokens a step) used to start and then run out of memory at its first big step.
    Start-up must now either accept it, having profiled that step, and run the issue's workload (256 x 1024-token
    prompts, max_tokens 4) with prompt logprobs on every row, or refuse it naming max_num_batched_tokens and a value
    that then runs that workload."""
    model = write_config(tmp_path, LLAMA_3_2_1B)
    args = dict(max_model_len=4352, max_num_seqs=256, gpu_memory_utilization=0.9)
    budget = 270000
    try:
        llm = start(model, max_num_batched_tokens=budget, **args)
    except RuntimeError as refused:
        found = re.search(r"max_num_batched_tokens=(\d+) fits", str(refused))
        assert "max_num_batched_tokens=270000 does not fit" in str(refused) and found, str(refused)
        budget = int(found.group(1))
        assert 256 <= budget < 270000
        del refused
        release()
        llm = start(model, max_num_batched_tokens=budget, **args)
    steps = record_steps(llm)
    outs = llm.generate(prompts(256, 1024, seed=1), costly(4), use_tqdm=False)      # the issue's max_tokens
    assert max(tokens for tokens, _ in steps) == min(budget, 256 * 1024)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    assert all(len(o.prompt_logprobs) == 1024 for o in outs)
    del llm
    release()
