"""Greedy tokens of two engines compared up to a near tie where they first part (a GPU against the CPU)."""

from __future__ import annotations

# A key element within fp32 noise of a rounding boundary lands on either side of it on the two devices (they
# compute k in other orders), and one code apart is 12.5% (E4M3) or 25% (E5M2) of it: enough to flip a greedy choice
# between two tokens the CPU scores within this many nats of each other.
NEAR_TIE_NATS = 0.1


def first_divergence_is_a_near_tie(want: list[int], got: list[int], cpu_logprobs) -> bool:
    """got == want, or at the first position they differ the CPU scored got's token within NEAR_TIE_NATS of its
    own choice (`cpu_logprobs`: the CPU run's top-2 per position)."""
    j = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
    if j is None:
        return len(want) == len(got)
    top = cpu_logprobs[j]
    return got[j] in top and top[want[j]].logprob - top[got[j]].logprob < NEAR_TIE_NATS
