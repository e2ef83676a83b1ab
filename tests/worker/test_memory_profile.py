"""Start-up memory accounting against a fake device budget (issue 20: what start-up accepts must run).

The runner asks a memory object (CudaMemory on a GPU) for the weights, the peak of each profiled step and the
device's free/total bytes. Here a fake answers from a cost model of the steps the profile runs (the tiny model
really runs them on the CPU), so the tests can check that the KV cache is sized from the largest step the scheduler
can form, and that a setting whose largest step does not fit is refused with a value that does."""

from __future__ import annotations

import re

import pytest
import torch

from deepserve.config import EngineArgs, SchedulerConfig
from deepserve.engine.block_manager import BlockManager
from deepserve.engine.scheduler import Scheduler
from deepserve.sampling_params import SamplingParams
from deepserve.sequence import Sequence, SequenceStatus
from deepserve.worker import memory_profile
from deepserve.worker.memory_profile import largest_steps
from deepserve.worker.model_runner import ModelRunner

MiB = 1 << 20


class FakeMemory:
    """A device of `total` bytes, `other` of them held by someone else; a step costs the weights plus `per_token`
    bytes a token plus `per_seq` a sequence. A step above `oom_above` bytes raises the CUDA out-of-memory error."""

    def __init__(self, total=256 * MiB, other=20 * MiB, weights=2 * MiB, per_token=16 << 10, per_seq=1 * MiB,
                 oom_above=None, engines_before=0):
        """`engines_before`: bytes this process's allocator already holds for other engines (their weights and KV)."""
        self.total, self.other, self.weights = total, other, weights
        self.per_token, self.per_seq, self.oom_above = per_token, per_seq, oom_above
        self.before = engines_before
        self.loaded = False         # the runner's first question comes before its model is loaded
        self.reclaimed = False
        self.peak = self.before + weights
        self.steps: list[list[int]] = []

    def cost(self, tokens: int, seqs: int) -> int:
        return self.before + self.weights + self.per_token * tokens + self.per_seq * seqs

    def run(self, query_lens: list[int]) -> None:
        cost = self.cost(sum(query_lens), len(query_lens))
        if self.oom_above is not None and cost > self.oom_above:
            raise torch.cuda.OutOfMemoryError("fake: out of memory")
        self.peak = max(self.peak, cost)
        self.steps.append(list(query_lens))

    def reclaim(self) -> None:
        self.reclaimed = True      # nothing dropped to collect here

    def allocated(self) -> int:
        held = self.before + (self.weights if self.loaded else 0)
        self.loaded = True
        return held

    def reset_peak(self) -> None:
        self.peak = self.before + self.weights

    def peak_allocated(self) -> int:
        return self.peak

    def info(self) -> tuple[int, int, int]:
        reserved = self.before + self.weights
        return self.total - self.other - reserved, self.total, reserved


class ProfilingRunner(ModelRunner):
    """The real runner; each profiled step is also charged to the fake memory (first: an OOM step never runs)."""

    def _dummy_forward(self, query_lens, seq_len):
        self.memory.run(query_lens)
        super()._dummy_forward(query_lens, seq_len)


def start(model, memory, max_num_batched_tokens, max_num_seqs=8, max_model_len=512, util=0.5):
    config = EngineArgs(model=model, device="cpu", skip_tokenizer_init=True, max_model_len=max_model_len,
                        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                        gpu_memory_utilization=util).create_engine_config()
    return ProfilingRunner(config, set(), memory=memory), config


def test_cache_is_sized_from_a_profile_of_the_largest_step(tiny_llama):
    memory = FakeMemory()
    runner, config = start(tiny_llama, memory, max_num_batched_tokens=1024)
    assert memory.reclaimed         # dropped engines' memory goes back before the runner measures its own
    assert memory.steps[0] == [512, 506, 1, 1, 1, 1, 1, 1]      # 1024 tokens, 8 sequences, a max_model_len chunk
    peak = memory.cost(1024, 8)
    assert runner.profiled_peak_bytes == peak
    room = int(memory.total * 0.5) - memory.other
    per_block = runner.kv_bytes_per_token() * config.cache.block_size
    assert config.cache.num_blocks == (room - peak) // per_block
    sizes = [1024 >> i for i in range(11)]         # then half, a quarter, ... one token (compiles, measures)
    fresh = [[512 >> i] for i in range(10)]        # then one fresh prompt of each size (compiles what serving meets)
    assert memory.steps == [shape for n in sizes for shape in largest_steps(n, 8, 512)] + fresh


def test_a_second_engine_in_the_process_is_sized_by_its_own_memory(tiny_llama):
    """Memory another engine of this process already holds (its weights and KV cache: here 100 MiB, more than
    this engine's whole share) is neither counted in this engine's profile nor refused: its budget is the one it
    gets alone."""
    alone_runner, alone = start(tiny_llama, FakeMemory(), max_num_batched_tokens=1024)
    second_runner, second = start(tiny_llama, FakeMemory(engines_before=100 * MiB), max_num_batched_tokens=1024)
    assert second_runner.profiled_peak_bytes == alone_runner.profiled_peak_bytes
    assert second.cache.num_blocks == alone.cache.num_blocks


def test_a_second_engine_takes_no_more_than_the_memory_left(tiny_llama):
    """Where earlier engines hold so much that this engine's share (108 MiB) is not there any more (200 MiB held,
    20 MiB others': 36 MiB left), the budget is what is left, not an allocation that runs out of memory."""
    memory = FakeMemory(engines_before=200 * MiB)
    runner, config = start(tiny_llama, memory, max_num_batched_tokens=256)
    left = memory.total - memory.other - 200 * MiB
    per_block = runner.kv_bytes_per_token() * config.cache.block_size
    assert config.cache.num_blocks == (left - runner.profiled_peak_bytes) // per_block


def test_a_refusal_names_the_memory_other_engines_hold(tiny_llama):
    """Where what earlier engines hold leaves too little for even this engine's largest step, the refusal says so
    (freeing them is the fix, not a lower token budget alone)."""
    with pytest.raises(RuntimeError, match=r"with 0\.22 GiB held by other engines or tensors of this process, the "
                       r"GPU has 0\.01 GiB left") as refused:
        start(tiny_llama, FakeMemory(engines_before=230 * MiB), max_num_batched_tokens=1024)
    assert "free the other engines" in str(refused.value)
    assert "raise gpu_memory_utilization" not in str(refused.value)


def _suggested(message: str) -> int:
    found = re.search(r"max_num_batched_tokens=(\d+) fits", message)
    assert found, message
    return int(found.group(1))


# 108 MiB are ours (half of 256 MiB, less 20 MiB of others'); 8192 tokens over 32 sequences cost 162 MiB, 16384 more
# than the 236 MiB the device has left, so that profile runs out of memory.
@pytest.mark.parametrize("tokens,oom_above", [(8192, None), (16384, 236 * MiB)])
def test_a_step_that_does_not_fit_is_refused_with_a_value_that_fits(tiny_llama, tokens, oom_above):
    memory = FakeMemory(oom_above=oom_above)
    with pytest.raises(RuntimeError, match=f"max_num_batched_tokens={tokens} does not fit") as refused:
        start(tiny_llama, memory, max_num_batched_tokens=tokens, max_num_seqs=32)
    message = str(refused.value)
    assert ("runs out of memory" in message) == (oom_above is not None)
    fits = _suggested(message)
    runner, config = start(tiny_llama, FakeMemory(oom_above=oom_above), max_num_batched_tokens=fits, max_num_seqs=32)
    assert config.cache.num_blocks * config.cache.block_size >= fits + 32 * 16    # the step's own KV fits too
    room = int(memory.total * 0.5) - memory.other
    assert memory.cost(fits + 512, 32) + runner.kv_budget.bytes_needed(fits + 512) > room   # not needlessly small


def test_weights_that_leave_no_room_are_refused_without_a_suggestion(tiny_llama):
    with pytest.raises(RuntimeError, match="even a one-token step does not fit"):
        start(tiny_llama, FakeMemory(weights=120 * MiB), max_num_batched_tokens=256)


def test_profile_logprobs_cover_what_sampling_params_allow():
    SamplingParams(logprobs=memory_profile.MAX_LOGPROBS, prompt_logprobs=memory_profile.MAX_LOGPROBS)
    with pytest.raises(ValueError):
        SamplingParams(prompt_logprobs=memory_profile.MAX_LOGPROBS + 1)


def test_largest_steps_shapes():
    assert largest_steps(2048, 256, 4352) == [[1793] + [1] * 255, [2048]]    # most sequences; longest chunk
    big = largest_steps(270000, 256, 4352)
    assert len(big) == 1 and sum(big[0]) == 270000 and len(big[0]) == 256 and max(big[0]) == 4352
    assert largest_steps(10**6, 4, 100) == [[100] * 4]            # 4 full chunks are all a step can hold
    assert largest_steps(3, 8, 100) == [[1, 1, 1], [3]]


def _scheduler_steps(budget: int, max_seqs: int, max_model_len: int, prompt_lens: list[int]):
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len,
                             enable_chunked_prefill=True)
    sched = Scheduler(config, BlockManager(1 << 14, 16, enable_prefix_caching=False))
    for i, n in enumerate(prompt_lens):
        prompt = [(i * 13 + j) % 400 + 3 for j in range(n)]
        sched.add(Sequence(i, str(i), 0, prompt, SamplingParams(max_tokens=max_model_len - n), seed=0))
    while sched.has_unfinished():
        out = sched.schedule()
        yield [s.num_new_tokens for s in out.scheduled]
        for s in out.scheduled:
            if s.samples:
                s.seq.append_token(5)
            if s.seq.num_tokens >= max_model_len:
                sched.finish(s.seq, SequenceStatus.FINISHED_LENGTH_CAPPED)


@pytest.mark.parametrize("budget,max_seqs,reached", [(1024, 8, False), (64, 32, True), (300, 4, True)])
def test_profiled_steps_bound_every_step_the_scheduler_forms(budget, max_seqs, reached):
    max_model_len = 160
    bound = largest_steps(budget, max_seqs, max_model_len)
    steps = list(_scheduler_steps(budget, max_seqs, max_model_len, [150, 3, 90, 159, 40, 7, 120, 60] * 3))
    most = max(sum(s) for s in steps)
    assert most == sum(bound[0]) if reached else most <= sum(bound[0])
    assert max(len(s) for s in steps) <= len(bound[0])
    assert max(max(s) for s in steps) <= max(max(shape) for shape in bound)
