"""DeepSeek's open-source EPLB policy, global variant, re-implemented for comparison only.

Written from the description in shared/reference/field.md §E4 (deepseek-ai/EPLB), not from its code:
the policy sees one load number per expert (load prediction is the caller's job; here: the window's
total), replicates by repeatedly giving a replica to the expert with the largest load per replica, then
packs the replicas onto GPUs heaviest first, each onto the lightest GPU that still has room. That is
the *global* policy (decode, large EP): the hierarchical one (groups to nodes first) needs expert groups
and nodes, which our signature does not carry.

Same signature and return type as deepserve.eplb.rebalance, so both run on the same loads and are scored
by the same deepserve.eplb.balance_ratio.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepserve.eplb import Placement, validate


def rebalance(tokens: Tensor, num_ranks: int, num_physical_experts: int) -> Placement:
    weight = validate(tokens, num_ranks, num_physical_experts).sum(0)  # [layers, experts]
    replicas, counts = replicate(weight, num_physical_experts)
    p2l = pack(weight, replicas, counts, num_ranks)
    return Placement.from_physical_to_logical(p2l, weight.shape[1])


def replicate(weight: Tensor, num_physical: int) -> tuple[Tensor, Tensor]:
    """Each extra slot to the expert with the largest weight / replica count (first on ties)."""
    layers, experts = weight.shape
    counts = torch.ones(layers, experts, dtype=torch.int64)
    extras = torch.empty(layers, num_physical - experts, dtype=torch.int64)
    rows = torch.arange(layers)
    for r in range(num_physical - experts):
        pick = (weight / counts).argmax(1)
        counts[rows, pick] += 1
        extras[:, r] = pick
    return torch.cat([torch.arange(experts).expand(layers, experts), extras], 1), counts


def pack(weight: Tensor, replicas: Tensor, counts: Tensor, num_ranks: int) -> Tensor:
    """Balanced packing: replicas heaviest first, each onto the least-loaded rank that is not full."""
    layers, physical = replicas.shape
    capacity = physical // num_ranks
    rows = torch.arange(layers)
    item = weight.gather(1, replicas) / counts.gather(1, replicas)
    order = item.sort(dim=1, descending=True, stable=True).indices
    rank_weight = torch.zeros(layers, num_ranks, dtype=torch.float64)
    filled = torch.zeros(layers, num_ranks, dtype=torch.int64)
    p2l = torch.empty(layers, physical, dtype=torch.int64)
    for k in range(physical):
        rep = order[:, k]
        rank = rank_weight.masked_fill(filled >= capacity, float("inf")).argmin(1)
        rank_weight[rows, rank] += item[rows, rep]
        p2l[rows, rank * capacity + filled[rows, rank]] = replicas[rows, rep]
        filled[rows, rank] += 1
    return p2l
