"""PyTorch math of DeepSeek-V4.1 attention (deepinfer.md §2.5, §2.6, §16.6-§16.10): what the CPU runs and what GPU
kernels are tested against. One sequence's rows at a time; fp32 math.

    sink_attention        one softmax over the visible keys plus a per-head sink logit in the denominator
    sink_attention_gathered   the same, each row over its own list of cache slots (the paged engine's form)
    index_logits          I(t, j) = Σ_h w[t, h] · relu(qi[t, h] · ki[j])
    topk_mask             the k best allowed entries per row (exact ties: lower index), as a mask
    candidate_block_mask  entries of the top blocks of consecutive entries, blocks scored by their max logit
    rope_interleaved      RoPE on pairs (2i, 2i+1) of the trailing dims, by tables of cos/sin
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def sink_attention(q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [n, nH, D], keys (= values) [K, D], mask [n, K] (True: visible), sink [nH] -> [n, nH, D] fp32:
    p_j = exp(s_j) / (Σ_k exp(s_k) + exp(sink_h)) with s = scale · q·k (the sink logit is not scaled)."""
    n, nH, _ = q.shape
    kf = keys.float()
    s = torch.einsum("thd,sd->ths", q.float(), kf) * scale
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    s = torch.cat((s, sink.float().view(1, nH, 1).expand(n, nH, 1)), dim=-1)
    p = s.softmax(-1)[..., :-1]
    return torch.einsum("ths,sd->thd", p, kf)


def sink_attention_gathered(q: torch.Tensor, sources: list[tuple[torch.Tensor, torch.Tensor]], sink: torch.Tensor,
                            scale: float, row_chunk: int = 64) -> torch.Tensor:
    """q [T, nH, D]; sources: (cache [S, D], slots [T, K] int64 with -1 = no key) pairs, e.g. the sliding-window
    keys and the selected compressed entries; keys = values = cache[slot]. -> [T, nH, D] fp32, one softmax over
    every row's keys of all sources plus the sink (see sink_attention). Rows go `row_chunk` at a time, which bounds
    the gathered keys ([rows, K, D]) at long contexts."""
    T, nH, D = q.shape
    out = torch.empty(T, nH, D, dtype=torch.float32, device=q.device)
    for r0 in range(0, T, row_chunk):
        rows = slice(r0, min(r0 + row_chunk, T))
        keys = torch.cat([cache[slots[rows].clamp(min=0)].float() for cache, slots in sources], dim=1)
        mask = torch.cat([slots[rows] >= 0 for _, slots in sources], dim=1)             # [n, K]
        s = torch.einsum("thd,tkd->thk", q[rows].float(), keys) * scale
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
        n = s.shape[0]
        s = torch.cat((s, sink.float().view(1, nH, 1).expand(n, nH, 1)), dim=-1)
        out[rows] = torch.einsum("thk,tkd->thd", s.softmax(-1)[..., :-1], keys)
    return out


def index_logits(qi: torch.Tensor, w: torch.Tensor, ki: torch.Tensor) -> torch.Tensor:
    """qi [n, Hi, Di], w [n, Hi], ki [N, Di] -> [n, N] fp32 (no global scale: it cannot change a top-k)."""
    dots = torch.einsum("thd,jd->thj", qi.float(), ki.float()).relu_()
    return torch.einsum("th,thj->tj", w.float(), dots)


def topk_indices(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """[n, N] -> [n, k] int64: per row the indices of the k largest allowed scores, best first; exact ties go to
    the lower index; fewer than k allowed -> padded with -1 (§16.9)."""
    n, N = scores.shape
    order = torch.sort(scores.masked_fill(~allowed, float("-inf")), dim=-1, descending=True, stable=True).indices
    order = F.pad(order[:, :k], (0, max(0, k - N)), value=-1)
    count = allowed.sum(-1, keepdim=True).clamp(max=k)
    return torch.where(torch.arange(k, device=scores.device)[None, :] < count, order, -1)


def topk_mask(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """[n, N] -> [n, N] bool: per row the k largest allowed scores; exact ties go to the lower index; fewer than
    k allowed -> all of them (§16.9)."""
    n, N = scores.shape
    if N == 0:
        return allowed
    order = torch.sort(scores.masked_fill(~allowed, float("-inf")), dim=-1, descending=True, stable=True).indices
    count = allowed.sum(-1, keepdim=True).clamp(max=k)
    rank = torch.arange(N, device=scores.device)[None, :]
    mask = torch.zeros_like(allowed)
    mask.scatter_(1, order, rank < count)
    return mask


def candidate_block_mask(logits: torch.Tensor, visible: torch.Tensor, block_size: int,
                         topk_blocks: int, select=None) -> torch.Tensor:
    """§16.10: aligned blocks [b·bs, (b+1)·bs) of entries scored by the max over their visible entries; the top
    `topk_blocks` blocks that have a visible entry are kept. [n, N] -> the entries of kept blocks [n, N].
    `select`: the top-k mask function (default `topk_mask`; the engine passes kernels/topk.py's twin)."""
    n, N = logits.shape
    n_blocks = -(-N // block_size)
    pad = n_blocks * block_size - N
    scores = F.pad(logits.masked_fill(~visible, float("-inf")), (0, pad), value=float("-inf"))
    block_scores = scores.view(n, n_blocks, block_size).amax(-1)
    block_visible = F.pad(visible, (0, pad), value=False).view(n, n_blocks, block_size).any(-1)
    kept = (select or topk_mask)(block_scores, block_visible, topk_blocks)
    return kept.repeat_interleave(block_size, dim=1)[:, :N]


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (2i, 2i+1) of the trailing R = 2·cos.shape[-1] dims of x [T, ..., D] by the per-row angles
    whose cos/sin are [T, R/2] (fp32); the leading D - R dims pass through. Returns x's dtype."""
    R = 2 * cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (R // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    x0, x1 = x[..., -R:].float().unflatten(-1, (R // 2, 2)).unbind(-1)
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-R], rotated.to(x.dtype)), dim=-1)
