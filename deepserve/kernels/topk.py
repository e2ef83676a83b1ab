"""Exact top-k by packed keys: per row the k largest allowed scores, exact ties to the lower index (§16.9), from
one `torch.topk` over int64 keys instead of the reference's full stable sort of every row
(kernels/reference/sparse_attention.py: `topk_indices`, `topk_mask`, the twins these are tested against).

Why: the indexer of a 16k-token DeepSeek-V4.1 prefill picks 512 of up to 16k entries for every row; sorting whole
rows took 59 of the step's 397 ms of device time on an H200 (benchmarks/profile_v41_prefill16k.json). A top-k
select does not sort what it drops.

The key of entry j in a row of N: (the float32 score as an order-preserving int32) * 2^32 + (N - 1 - j). Keys are
distinct, and their order is (score descending, index ascending), exactly the stable sort's, so the k largest keys
are the reference's first k entries in the reference's order, whatever ties there are. Order-preserving int32: the
float's bits for a non-negative float; for a negative one, the bits with every bit but the sign flipped (larger
magnitudes become smaller ints). -0.0 is first made +0.0, as the float comparison treats them as equal.
"""

from __future__ import annotations

import torch


def _packed_keys(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """[n, N] float scores (masked by `allowed`: -inf) -> [n, N] int64 distinct keys, ordered as the stable sort."""
    n, N = scores.shape
    s = scores.float().masked_fill(~allowed, float("-inf")) + 0.0          # + 0.0: -0.0 -> +0.0
    bits = s.view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
    low = (N - 1) - torch.arange(N, device=scores.device, dtype=torch.int64)
    return ordered * (1 << 32) + low


def topk_indices(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """[n, N] -> [n, k] int64: per row the indices of the k largest allowed scores, best first; exact ties go to
    the lower index; fewer than k allowed -> padded with -1. Same result as the reference's, bit for bit."""
    n, N = scores.shape
    out = torch.full((n, k), -1, dtype=torch.int64, device=scores.device)
    take = min(k, N)
    if n == 0 or take == 0:
        return out
    top = _packed_keys(scores, allowed).topk(take, dim=-1, sorted=True).values
    index = (N - 1) - (top & 0xFFFFFFFF)
    count = allowed.sum(-1, keepdim=True).clamp(max=k)
    rank = torch.arange(take, device=scores.device)[None, :]
    out[:, :take] = torch.where(rank < count, index, -1)
    return out


def topk_mask(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """[n, N] -> [n, N] bool: per row the k largest allowed scores; exact ties go to the lower index; fewer than
    k allowed -> all of them."""
    n, N = scores.shape
    if N == 0 or n == 0 or k <= 0:
        return torch.zeros_like(allowed)
    index = topk_indices(scores, allowed, min(k, N))
    # Padding (-1) goes to an extra column, dropped after: no two writes land on one entry.
    mask = torch.zeros(n, N + 1, dtype=torch.bool, device=scores.device)
    mask.scatter_(1, torch.where(index >= 0, index, N), True)
    return mask[:, :N]


__all__ = ["topk_indices", "topk_mask"]
