"""What the start-up memory profile needs besides the runner itself: the device's allocator behind a small
interface (a test hands the runner a fake), the shapes of the largest steps a token budget allows, and the budget a
refused configuration should use instead."""

from __future__ import annotations

import gc

import torch

from deepserve.layers.sampler import SamplingMetadata, SamplingRow
from deepserve.sampling_params import SamplingParams

MAX_LOGPROBS = 20      # the most (prompt_)logprobs SamplingParams accepts: the profile's top-k


class CudaMemory:
    """What the memory profile asks of the device. The runner calls an object like this one, so that a test can
    hand it a fake with a budget of its choosing."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reclaim(self) -> None:
        """Collect garbage and hand the allocator's unused cache back. An engine dropped while its objects sit in a
        reference cycle (`del llm` with the handle in one) holds its weights and KV cache until the collector runs;
        the next engine would otherwise be sized around them (tests/gpu/test_memory_profile_gpu.py). A pass that
        found garbage is followed by one more, for what its finalizers handed back (a dropped LLM's finalizer
        unfreezes its engine's start-up heap, engine/startup_heap.py); on the CPU one pass freed such an engine."""
        if gc.collect():
            gc.collect()
        torch.cuda.empty_cache()

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def info(self) -> tuple[int, int, int]:
        """(free, total, reserved by this process's allocator), once the allocator's unused cache is released."""
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return free, total, torch.cuda.memory_reserved(self.device)


def largest_steps(max_tokens: int, max_seqs: int, max_model_len: int) -> list[list[int]]:
    """Chunk lengths of the largest steps the scheduler can form under a budget of `max_tokens`: the most tokens
    (a chunk is at most max_model_len long) over the most sequences, with chunks as long as the rest allows; and,
    when that shape cannot hold a chunk of the longest length too, a second step of the fewest, longest chunks
    (attention workspace grows with a chunk's length; the sampler's with the sequence count)."""
    tokens = min(max_tokens, max_seqs * max_model_len)
    longest = min(tokens, max_model_len)
    steps = [_spread(tokens, min(max_seqs, tokens), longest)]
    if steps[0][0] < longest:
        steps.append(_spread(tokens, -(-tokens // longest), longest))
    return steps


def _spread(tokens: int, seqs: int, longest: int) -> list[int]:
    """`seqs` chunk lengths summing to `tokens`, each at most `longest`, the first ones as long as they can be."""
    lens = []
    for i in range(seqs):
        lens.append(min(longest, tokens - (seqs - i - 1)))
        tokens -= lens[-1]
    return lens


def fitting_budget(peaks: dict[int, int | None], weights: int, room: int, kv_bytes_needed) -> int | None:
    """The largest token budget below the profiled ones whose step peak plus `kv_bytes_needed(budget)` stays within
    `room`, the peak estimated on the line through the two largest sizes that ran (the weights at 0 tokens when only
    one did); a multiple of 256 from 512 on. None when no budget fits."""
    ran = sorted((n, p) for n, p in peaks.items() if p is not None)
    if not ran:
        return None
    (n0, p0), (n1, p1) = ([(0, weights)] + ran)[-2:]
    per_token = max((p1 - p0) / (n1 - n0), 1.0)
    lo, hi = 0, max(peaks) - 1          # both costs grow with the budget: bisect for the last one that fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if p1 + per_token * (mid - n1) + kv_bytes_needed(mid) <= room:
            lo = mid
        else:
            hi = mid - 1
    fit = lo // 256 * 256 if lo >= 512 else lo
    return fit or None


def costliest_sampling(rows: int, vocab_size: int, device: torch.device) -> SamplingMetadata:
    """Sampling metadata that takes every path of the sampler: penalties ([rows, vocab] counts and masks),
    top-k / top-p (a full sort), min_p, logprobs, and one greedy row beside the drawn ones."""
    drawn = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                           presence_penalty=0.5, frequency_penalty=0.5, logprobs=MAX_LOGPROBS)
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.1, logprobs=MAX_LOGPROBS)
    sampling_rows = [SamplingRow(greedy if i == 0 and rows > 1 else drawn, seed=i, position=1, prompt_token_ids=[0],
                                 output_token_ids=[0], eos_token_ids=set()) for i in range(rows)]
    return SamplingMetadata.build(sampling_rows, vocab_size, device)
