"""Probability shaping and the inverse-CDF draw in plain PyTorch: the twin of kernels/sampling.py.

Rows are independent: a row whose parameters switch a step off (top_k = vocab, top_p = 1, min_p = 0) goes
through it unchanged bit for bit, so a row's token never depends on the other rows of its batch.
"""

from __future__ import annotations

import torch


def shaped_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None = None,
                 top_p: torch.Tensor | None = None, min_p: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(logits / T), then top-k, top-p (given top_k and top_p) and min_p (given min_p) zero out tokens; not
    renormalised (the inverse CDF scales its uniform by the kept mass instead, which is the same draw without
    another rounding). logits [B, V] float32; the parameters [B]."""
    scaled = logits / temperature[:, None]
    probs = torch.softmax(scaled, dim=-1)
    if top_k is not None and top_p is not None:
        probs = apply_top_k_top_p(scaled, probs, top_k, top_p)
    if min_p is not None:
        probs = apply_min_p(probs, min_p)
    return probs


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse CDF in float64 over vocabulary order: the first index i with cdf[i] > u * total.
    A token of probability 0 can never be chosen: the cdf does not rise at it."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    targets = uniforms[:, None] * cdf[:, -1:]
    index = torch.searchsorted(cdf, targets, right=True)[:, 0]
    return index.clamp_(max=probs.shape[-1] - 1)


def apply_top_k_top_p(scaled_logits: torch.Tensor, probs: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens outside the top k, then outside the smallest set (by descending probability) whose mass
    reaches top_p of what top-k kept. Only a mask is computed in sorted order; kept probabilities keep their
    exact values, so a row with both disabled is unchanged bit for bit."""
    # Stable descending sort: among equal logits the lowest index ranks first, as argmax does.
    order = torch.sort(scaled_logits, dim=-1, descending=True, stable=True).indices
    sorted_probs = probs.gather(-1, order)
    ranks = torch.arange(probs.shape[-1], device=probs.device)
    drop = ranks[None, :] >= top_k[:, None]
    sorted_probs = sorted_probs.masked_fill(drop, 0.0).double()
    cumulative = torch.cumsum(sorted_probs, dim=-1)
    mass_before = cumulative - sorted_probs
    # The top token has mass_before 0 < top_p, so it always survives; top_p >= 1 keeps everything top-k kept.
    beyond_p = (mass_before >= top_p[:, None].double() * cumulative[:, -1:]) & (top_p[:, None] < 1)
    drop = drop | beyond_p
    drop_in_vocab_order = torch.zeros_like(drop).scatter_(-1, order, drop)
    return probs.masked_fill(drop_in_vocab_order, 0.0)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero tokens less likely than min_p x the most likely one; min_p = 0 drops nothing."""
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < threshold, 0.0)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, is_greedy: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Greedy rows: argmax; others: the shaped inverse-CDF draw at `uniforms` [B] float64."""
    logits = logits.float()
    sampled = sample_from_probs(shaped_probs(logits, temperature.float(), top_k.long(), top_p.float(),
                                             min_p.float()), uniforms.to(torch.float64))
    return torch.where(is_greedy.bool(), logits.argmax(dim=-1), sampled)


__all__ = ["apply_min_p", "apply_top_k_top_p", "sample_from_probs", "sample_tokens", "shaped_probs"]
