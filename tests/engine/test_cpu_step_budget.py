"""The CPU's default step budget: while a sequence decodes, a step carries at most
CPU_MAX_PREFILL_TOKENS_WHILE_DECODING prefill tokens (so a decode never waits behind a long prompt chunk),
long prompts still complete in chunks, and the GPU and explicit max_num_batched_tokens settings are unchanged."""

from __future__ import annotations

import torch

from deepserve import SamplingParams
from deepserve.config import CPU_MAX_PREFILL_TOKENS_WHILE_DECODING as CAP
from deepserve.config import EngineArgs
from deepserve.engine.block_manager import BlockManager
from deepserve.engine.engine import LLMEngine
from deepserve.engine.scheduler import Scheduler
from deepserve.sequence import Sequence, SequenceStatus


def cpu_config(model: str, **kwargs):
    return EngineArgs(model=model, device="cpu", skip_tokenizer_init=True, **kwargs).create_engine_config()


def test_cap_is_a_cpu_default_only(tiny_llama):
    assert cpu_config(tiny_llama).scheduler.max_prefill_tokens_while_decoding == CAP
    assert cpu_config(tiny_llama).scheduler.max_num_batched_tokens == 2048        # the budget itself is unchanged
    explicit = cpu_config(tiny_llama, max_num_batched_tokens=1024).scheduler
    assert explicit.max_prefill_tokens_while_decoding is None and explicit.max_num_batched_tokens == 1024
    assert cpu_config(tiny_llama, enable_chunked_prefill=False).scheduler.max_prefill_tokens_while_decoding is None
    gpu_args = EngineArgs(model=tiny_llama)
    assert gpu_args._prefill_cap_while_decoding(torch.device("cuda")) is None


def _step_shape(out) -> tuple[int, int, bool]:
    """(all tokens, prefill tokens, whether a decode is in the step). A decode row is a sequence whose prompt was
    already computed; every other scheduled row is a prompt chunk."""
    decodes = [s for s in out.scheduled if s.start >= s.seq.num_prompt_tokens]
    prefill = sum(s.num_new_tokens for s in out.scheduled if s.start < s.seq.num_prompt_tokens)
    return out.num_batched_tokens, prefill, bool(decodes)


def _run(sched: Scheduler, arrivals: dict[int, list[Sequence]], max_steps: int = 400) -> list[tuple[int, int, bool]]:
    """Drive the scheduler as the engine does (a sampled token per sampling row); `arrivals[step]` join then."""
    shapes = []
    for step in range(max_steps):
        for seq in arrivals.get(step, []):
            sched.add(seq)
        if not sched.has_unfinished():
            return shapes
        out = sched.schedule()
        shapes.append(_step_shape(out))
        for s in out.scheduled:
            if s.samples:
                s.seq.append_token(5)
            sched.commit(s.seq)
            if s.seq.num_output_tokens >= s.seq.params.max_tokens:
                sched.finish(s.seq, SequenceStatus.FINISHED_LENGTH_CAPPED)
    raise AssertionError("requests did not finish")


def _seq(seq_id: int, prompt_len: int, max_tokens: int) -> Sequence:
    prompt = [(seq_id * 31 + i) % 500 + 3 for i in range(prompt_len)]      # distinct: no prefix-cache hits
    return Sequence(seq_id, f"r{seq_id}", 0, prompt, SamplingParams(max_tokens=max_tokens), seed=0)


def test_cpu_scheduler_caps_prefill_while_decoding_and_long_prompts_complete(tiny_llama):
    config = cpu_config(tiny_llama, max_model_len=1024).scheduler
    sched = Scheduler(config, BlockManager(4096, 16, enable_prefix_caching=False))
    short = [_seq(i, 20, 40) for i in range(6)]
    long = [_seq(100 + i, 700 + 50 * i, 4) for i in range(3)]        # each needs several capped chunks
    shapes = _run(sched, {0: short, 3: long[:2], 9: long[2:]})
    assert shapes[0] == (120, 120, False)       # nothing decodes yet: prompts enter with the whole budget
    with_decodes = [s for s in shapes if s[2]]
    assert with_decodes and all(prefill <= CAP for _, prefill, _ in with_decodes)
    assert max(prefill for _, prefill, _ in with_decodes) == CAP     # the cap is used, not just respected
    assert all(total <= config.max_num_batched_tokens for total, _, _ in shapes)
    for s in short + long:
        assert s.status is SequenceStatus.FINISHED_LENGTH_CAPPED and s.num_output_tokens == s.params.max_tokens
    assert sum(p for _, p, _ in shapes) == sum(s.num_prompt_tokens for s in short + long)   # no recompute needed


def test_explicit_budget_is_respected_on_the_cpu(tiny_llama):
    config = cpu_config(tiny_llama, max_model_len=1024, max_num_batched_tokens=512).scheduler
    sched = Scheduler(config, BlockManager(4096, 16, enable_prefix_caching=False))
    shapes = _run(sched, {0: [_seq(1, 20, 30)], 2: [_seq(2, 900, 4)]})
    with_decodes = [s for s in shapes if s[2]]
    assert max(prefill for _, prefill, _ in with_decodes) == 511       # 512 minus the running decode


def test_engine_on_cpu_serves_long_prompts_beside_decodes(tiny_llama):
    """End to end on the tiny model: decodes run while two long prompts arrive; every step the engine forms keeps the
    cap, and every request returns all its tokens."""
    engine = LLMEngine(cpu_config(tiny_llama, max_model_len=1024))
    shapes = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        shapes.append(_step_shape(out))
        return out

    engine.scheduler.schedule = recording_schedule
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"short{i}", {"prompt_token_ids": list(range(3 + i, 30 + i))}, params)
    finished = {}
    for step in range(300):
        if step == 2:
            for i in range(2):
                engine.add_request(f"long{i}", {"prompt_token_ids": [(7 * j + i) % 500 + 3 for j in range(600)]},
                                   params)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if len(finished) == 6:
            break
    assert sorted(finished) == ["long0", "long1", "short0", "short1", "short2", "short3"]
    assert all(len(o.outputs[0].token_ids) == 24 for o in finished.values())
    assert all(prefill <= CAP for _, prefill, decoding in shapes if decoding)
    assert sum(1 for _, prefill, decoding in shapes if decoding and prefill == CAP) >= 2 * 600 // CAP - 2
