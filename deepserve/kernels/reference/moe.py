"""Mixture-of-experts routing and the routed-expert sum in plain PyTorch: the twin of kernels/moe_routing.py and
kernels/fused_moe.py.

Router variants, all as `RoutingConfig`:
  softmax + greedy top-k           Mixtral (renormalize), Qwen3-MoE (renormalize = norm_topk_prob)
  softmax + group_limited_greedy   DeepSeek-V2: keep the `topk_groups` groups with the best expert, then top-k
  sigmoid + noaux_tc               DeepSeek-V3: choice score = sigmoid + e_score_correction_bias; a group's score
                                   is the sum of its two best choice scores; weights use the unbiased sigmoid
  sqrtsoftplus + noaux_tc          DeepSeek-V4.1: score = sqrt(softplus(logit)), same bias rule, no groups
Ties always go to the lower expert id (a stable sort, not `torch.topk`, whose tie order is unspecified).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deepserve.kernels.reference.activation import swiglu

SCORING_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class RoutingConfig:
    top_k: int
    scoring: str = "softmax"
    topk_method: str = "greedy"
    num_groups: int = 1               # experts are split into this many equal groups (group-limited methods)
    topk_groups: int = 1              # groups a token may use
    renormalize: bool = False         # weights of the chosen experts divided by their sum
    scaling_factor: float = 1.0       # DeepSeek's routed_scaling_factor, applied after renormalizing

    def __post_init__(self) -> None:
        if self.scoring not in SCORING_FUNCS:
            raise ValueError(f"MoE scoring function {self.scoring!r} not supported; one of {SCORING_FUNCS}")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"MoE topk_method {self.topk_method!r} not supported; one of {TOPK_METHODS}")

    @property
    def uses_bias(self) -> bool:
        return self.topk_method == "noaux_tc"


def route(logits: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor | None = None):
    """logits: [T, E] float32 -> (weights [T, k] float32, expert ids [T, k] int64)."""
    scores = _score(logits, cfg.scoring)
    # The correction bias steers which experts are chosen, never how much they weigh.
    choice = scores + bias if bias is not None else scores
    if cfg.topk_method != "greedy" and cfg.num_groups > 1:
        choice = _mask_groups(choice, cfg)
    ids = stable_topk_ids(choice, cfg.top_k)
    weights = scores.gather(1, ids)
    if cfg.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if cfg.scaling_factor != 1.0:
        weights = weights * cfg.scaling_factor
    return weights, ids


def count_expert_load(expert_load: torch.Tensor, ids: torch.Tensor) -> None:
    """expert_load [E] += how often each expert appears in ids. index_add_ rather than bincount: a fixed output
    shape, so it can live inside a CUDA graph."""
    expert_load.index_add_(0, ids.flatten(), torch.ones_like(ids.flatten()))


def _score(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    if scoring == "softmax":
        return logits.softmax(dim=-1)
    if scoring == "sigmoid":
        return logits.sigmoid()
    return F.softplus(logits).sqrt()      # softplus(x) = x above 20, as the V4.1 spec says (torch's threshold)


def _mask_groups(choice: torch.Tensor, cfg: RoutingConfig) -> torch.Tensor:
    """Experts outside the token's `topk_groups` best groups get -inf."""
    t, e = choice.shape
    grouped = choice.view(t, cfg.num_groups, e // cfg.num_groups)
    if cfg.topk_method == "noaux_tc":
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)     # V3: sum of the group's two best
    else:
        group_scores = grouped.max(dim=-1).values                     # V2: the group's best expert
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, stable_topk_ids(group_scores, cfg.topk_groups), True)
    return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(t, e)


def stable_topk_ids(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries per row; equal values resolve to the lower index."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]


def expert_swiglu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, limit: float | None = None,
                  linear=F.linear) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) for one expert's stacked weights; `linear(x, w)` computes each projection (the
    batch-invariant mode passes layers/linear.invariant_linear)."""
    return linear(swiglu(linear(x, w13), limit), w2)


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, swiglu_limit: float | None = None,
                shared_out: torch.Tensor | None = None, linear=F.linear) -> torch.Tensor:
    """x: [T, H]; w13: [E, 2I, H] (gate rows then up rows); w2: [E, H, I]; topk_weights: [T, k] float32;
    topk_ids: [T, k] int64; shared_out: None or [T, H] -> [T, H] in x's dtype: each token's weighted expert sum
    plus shared_out, in float32 and rounded once. (Token, expert) pairs are sorted by expert, one GEMM pair per
    expert that got tokens, through `linear` (see expert_swiglu)."""
    t, k = topk_ids.shape
    flat_ids = topk_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)          # pair p = token p // k, its (p % k)-th expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    inputs = x[order // k]
    outputs = torch.empty_like(inputs)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            rows = slice(start, start + n)
            outputs[rows] = expert_swiglu(inputs[rows], w13[expert], w2[expert], swiglu_limit, linear)
            start += n
    per_pair = torch.empty_like(outputs)
    per_pair[order] = outputs
    # Summing each token's k outputs in slot order (not via scattered adds) keeps a token's result
    # independent of what else is in the batch.
    combined = (per_pair.view(t, k, w2.shape[1]).float() * topk_weights[:, :, None].float()).sum(dim=1)
    if shared_out is not None:
        combined += shared_out.float()      # in float32 too: the result is rounded to x's dtype once
    return combined.to(x.dtype)


@dataclass(frozen=True)
class PairRows:
    """A MoE layer's output before its combine (kernels/fused_moe.py `fused_moe(..., combine=False)`): every
    (token, slot) pair's expert output, already weighted and rounded to the activation dtype, `pair_out`
    [T * top_k, H] with token t's slots at rows t * top_k + j; and the shared experts' output [T, H] or None.

    The add + RMSNorm that reads the layer's output (layers/norm.py RMSNorm) sums each token's rows as it loads
    them (kernels/norm.py `combine_add_rms_norm`): one launch and one [T, H] write and read fewer per MoE layer.
    `combined()` is the combine itself, the twin of kernels/fused_moe.py `moe_combine`."""

    pair_out: torch.Tensor
    top_k: int
    shared_out: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.pair_out.shape[0] // self.top_k

    def __getitem__(self, tokens) -> "PairRows":
        """The rows of the tokens `tokens` selects (a slice or an index tensor): what `out[tokens]` is for the
        combined output, e.g. the rows a model samples from (models/base.py CausalLM.forward)."""
        hidden = self.pair_out.shape[1]
        pairs = self.pair_out.view(self.num_tokens, self.top_k, hidden)[tokens].reshape(-1, hidden)
        shared = None if self.shared_out is None else self.shared_out[tokens]
        return PairRows(pairs, self.top_k, shared)

    def combined(self) -> torch.Tensor:
        """[T, H]: each token's rows added in slot order, then the shared output, in float32, rounded once."""
        rows = self.pair_out.view(self.num_tokens, self.top_k, self.pair_out.shape[1])
        acc = rows[:, 0].float()
        for j in range(1, self.top_k):
            acc = acc + rows[:, j].float()
        if self.shared_out is not None:
            acc = acc + self.shared_out.float()
        return acc.to(self.pair_out.dtype)


__all__ = ["PairRows", "RoutingConfig", "SCORING_FUNCS", "TOPK_METHODS", "count_expert_load", "expert_swiglu",
           "moe_experts", "route", "stable_topk_ids"]
