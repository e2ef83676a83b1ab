"""How many bytes the KV cache gets at start-up: what the config says (`kv_cache_memory_bytes`), on the CPU enough
for every sequence at full length (capped), on a GPU what a profile of the largest step the scheduler can form
leaves of the device's share. What start-up accepts must run: a setting whose largest step leaves too little cache
for that step's own tokens and one max_model_len sequence is refused here, naming a value that fits.

The profile runs real steps through the runner's forward (`forward(query_lens, seq_len)`, its `_dummy_forward`)
with every layer's cache one dummy block; worker/memory_profile.py has the device's allocator behind a small
interface (a test hands in a fake) and the shapes of the largest steps."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from deepserve.config import EngineConfig
from deepserve.worker.kv_cache import KVCacheLayout
from deepserve.worker.memory_profile import CudaMemory, fitting_budget, largest_steps

logger = logging.getLogger(__name__)

CUDA_GRAPH_RESERVE = 512 << 20   # graph pool (activations of the largest decode batch) and fragmentation


class KVCacheBudget:
    """The KV budget of one runner. `memory`: the device's allocator (None on the CPU); `memory_before`: what the
    process held before this engine loaded its weights (another engine's weights and cache), left out of the
    profile so a second engine in one process is sized by its own share."""

    def __init__(self, config: EngineConfig, model, kv_layout: KVCacheLayout, memory: CudaMemory | None,
                 memory_before: int, forward: Callable[[list[int], int], None]) -> None:
        self.config = config
        self.model = model
        self.kv_layout = kv_layout
        self.memory = memory
        self.memory_before = memory_before
        self.forward = forward
        self.device = config.device.device
        self.peak_bytes: int | None = None       # the profiled step's peak (weights included), once profiled

    def budget_bytes(self) -> int:
        cache = self.config.cache
        if cache.kv_cache_memory_bytes is not None:
            return cache.kv_cache_memory_bytes
        if self.memory is not None:
            return self._profiled_budget()
        # CPU: enough for every sequence at full length, capped at 1 GiB (zeroing more costs start-up time).
        return min(self.kv_layout.wanted_bytes(), 1 << 30)

    def _profiled_budget(self) -> int:
        """gpu_memory_utilization x total, minus what is not ours (other processes, the CUDA context), the weights,
        the peak of the largest step the scheduler can form (measured by running it), and room for CUDA graphs."""
        util = self.config.cache.gpu_memory_utilization
        weights = self.memory.allocated() - self.memory_before
        peaks = self._profile_run()
        free, total, reserved = self.memory.info()
        not_torch = total - free - reserved
        graphs = CUDA_GRAPH_RESERVE if self.device.type == "cuda" and not self.config.device.enforce_eager else 0
        room = int(total * util) - not_torch - graphs        # for the largest step and the KV cache
        # Each engine's share is its own (memory_before is not counted against it), but it cannot take what earlier
        # engines of this process still hold (alive: dropped ones were collected before memory_before was taken),
        # or the cache's allocation would run out of memory: two engines at 0.6 get 0.6 and what is left.
        left = total - not_torch - self.memory_before - graphs
        capped = room > left
        if capped:
            logger.warning("gpu_memory_utilization=%s asks for %.2f GiB, but this process already holds %.2f GiB "
                           "(other engines or tensors): sizing from the %.2f GiB left", util,
                           (room + graphs) / 2**30, self.memory_before / 2**30, (left + graphs) / 2**30)
            room = left
        tokens = self.config.scheduler.max_num_batched_tokens
        peak = peaks[tokens]
        if peak is None or room - peak < self.bytes_needed(tokens):
            raise RuntimeError(self._refusal(peaks, weights, room, capped))
        self.peak_bytes = peak
        logger.info("memory profile: peak %.2f GiB (weights + largest step), other %.2f GiB, KV budget %.2f GiB",
                    peak / 2**30, not_torch / 2**30, (room - peak) / 2**30)
        return room - peak

    def bytes_needed(self, tokens: int) -> int:
        """The least KV cache a token budget is served with: the blocks of its largest step's own keys and values
        (chunks of fresh prompts, each rounded up to whole blocks), and at least those of one max_model_len sequence
        (less could not serve every request start-up accepts)."""
        sched, bs = self.config.scheduler, self.config.cache.block_size
        step = largest_steps(tokens, sched.max_num_seqs, sched.max_model_len)[0]
        blocks = max(-(-sum(step) // bs) + len(step), -(-sched.max_model_len // bs))
        return blocks * self.kv_layout.main_bytes_per_block() + self.kv_layout.least_window_bytes()

    def _refusal(self, peaks: dict[int, int | None], weights: int, room: int, capped: bool = False) -> str:
        sched, util = self.config.scheduler, self.config.cache.gpu_memory_utilization
        n = sched.max_num_batched_tokens
        steps = largest_steps(n, sched.max_num_seqs, sched.max_model_len)
        peak, need = peaks[n], self.bytes_needed(n)
        what = "runs out of memory" if peak is None else f"peaks at {peak / 2**30:.2f} GiB with the weights"
        fits = fitting_budget(peaks, weights, room, self.bytes_needed)
        hint = (f"max_num_batched_tokens={fits} fits (estimated from the profile); or " if fits is not None
                else "even a one-token step does not fit; ")
        share = (f"with {self.memory_before / 2**30:.2f} GiB held by other engines or tensors of this process, "
                 f"the GPU has {room / 2**30:.2f} GiB left" if capped
                 else f"gpu_memory_utilization={util} leaves {room / 2**30:.2f} GiB")
        fix = ("free the other engines (del, then gc.collect()), or lower max_model_len or max_num_seqs" if capped
               else "raise gpu_memory_utilization, or lower max_model_len or max_num_seqs")
        return (f"max_num_batched_tokens={n} does not fit in GPU memory: its largest step ({sum(steps[0])} tokens over "
                f"{len(steps[0])} sequences, every row's hidden state as prompt logprobs may ask) {what}, and {share} "
                f"for the weights, that step and a KV cache for its tokens and at least one "
                f"max_model_len={sched.max_model_len} sequence ({need / 2**30:.2f} GiB). {hint}{fix}")

    @torch.inference_mode()
    def _profile_run(self) -> dict[int, int | None]:
        """Peak memory (weights included) of the largest step under token budgets of max_num_batched_tokens, half,
        a quarter, ... one; None where it ran out of memory. Caches are one dummy block (every block table points
        at it; writes land in it).

        The smaller sizes, and fresh prompts of each size, also compile, at start-up instead of in the middle of
        serving (a Triton compile takes 1-4 s), the kernels whose launch configuration depends on the step size
        (the fused MoE picks its mode and tiles by tokens per expert)."""
        sched = self.config.scheduler
        layers = self.model.attention_layers()
        for layer in layers:
            layer.kv_cache = torch.zeros(layer.kv_cache_shape(1, self.config.cache.block_size),
                                         dtype=self.kv_layout.cache_dtype(layer), device=self.device)
        peaks = {}
        n = sched.max_num_batched_tokens
        while n >= 1:
            peaks[n] = self._measure_largest_step(n)
            n //= 2
        # The largest steps are chunks over a long prefix; what serving meets first is fresh prompts. Compile their
        # kernel variants here too (one prompt of each size), or the first prefills pay for it (an H200 run without
        # this: 4 ms more on a 128-token prefill from the warm disk cache, ~1 s a variant from a cold one).
        n = min(sched.max_num_batched_tokens, sched.max_model_len)
        while n >= 1:
            self.forward([n], n)
            n //= 2
        for layer in layers:
            layer.kv_cache = None
        return peaks

    def _measure_largest_step(self, tokens: int) -> int | None:
        sched = self.config.scheduler
        self.memory.reset_peak()
        try:
            for query_lens in largest_steps(tokens, sched.max_num_seqs, sched.max_model_len):
                self.forward(query_lens, sched.max_model_len)
            return self.memory.peak_allocated() - self.memory_before
        except torch.cuda.OutOfMemoryError:
            return None      # refused by _profiled_budget when it is the configured size


__all__ = ["CUDA_GRAPH_RESERVE", "KVCacheBudget"]
