"""Expert-parallel load balancing policy (deepinfer.md §7): replication, then placement.

A pure function of windowed statistics, with no engine dependency, so the engine, tests and
benchmarks all call the same thing:

    placement = rebalance(tokens[steps, layers, experts], num_ranks, num_physical_experts)

Physical slot p lives on rank p // (num_physical_experts // num_ranks). The objective is the windowed
sum of the per-step slowest rank's load, not the load of the window as one lump: two experts that are
hot in different steps can share a rank, which a total-load policy cannot see.

Every step is batched over layers (layers are independent and have the same number of rounds), so the
Python loops run once per extra slot and once per physical slot, not once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# Added to expert e's per-replica load during replication so that equal loads are ordered by index and the
# choice is deterministic; small against any real token count.
TIE_BREAK = 1e-4


@dataclass(frozen=True)
class Placement:
    """Where each logical expert's replicas live. All tensors int64; layers first."""

    physical_to_logical: Tensor  # [layers, num_physical_experts]
    logical_to_physical: Tensor  # [layers, experts, max_replicas], -1 padded, slots ascending
    replica_counts: Tensor  # [layers, experts]

    @classmethod
    def from_physical_to_logical(cls, physical_to_logical: Tensor, num_experts: int) -> "Placement":
        """Derive the other two maps, so every policy builds them the same way.

        max_replicas = physical - experts + 1 (the most any expert can get), so the shape depends only
        on the configuration and an engine can copy new maps into fixed buffers."""
        p2l = physical_to_logical.to(torch.int64)
        layers, physical = p2l.shape
        counts = torch.zeros(layers, num_experts, dtype=torch.int64)
        counts.scatter_add_(1, p2l, torch.ones_like(p2l))
        # Sorting by (expert, slot) groups each expert's slots together, ascending.
        slots = (p2l * physical + torch.arange(physical)).sort(dim=1).indices
        experts = p2l.gather(1, slots)
        first = counts.cumsum(1) - counts
        index = torch.arange(physical).expand(layers, physical) - first.gather(1, experts)
        l2p = torch.full((layers, num_experts, physical - num_experts + 1), -1, dtype=torch.int64)
        l2p[torch.arange(layers)[:, None], experts, index] = slots
        return cls(p2l, l2p, counts)


def validate(tokens: Tensor, num_ranks: int, num_physical_experts: int) -> Tensor:
    """Check the inputs and return the counts as float64 (exact for any realistic count, and the
    per-step sums must compare equal when they tie)."""
    if not isinstance(tokens, Tensor):
        raise ValueError(f"tokens must be a torch.Tensor, got {type(tokens).__name__}")
    if tokens.dim() != 3:
        raise ValueError(f"tokens must be [steps, layers, experts], got {tokens.dim()} dims {tuple(tokens.shape)}")
    if min(tokens.shape) < 1:
        raise ValueError(f"tokens must have at least one step, layer and expert, got {tuple(tokens.shape)}")
    if tokens.is_complex() or tokens.dtype == torch.bool:
        raise ValueError(f"tokens must be integer or floating point counts, got {tokens.dtype}")
    if int(num_ranks) != num_ranks or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive integer, got {num_ranks}")
    experts = tokens.shape[2]
    if int(num_physical_experts) != num_physical_experts or num_physical_experts < experts:
        raise ValueError(
            f"num_physical_experts ({num_physical_experts}) must be an integer >= the number of logical experts ({experts})"
        )
    if num_physical_experts % num_ranks:
        raise ValueError(f"num_physical_experts ({num_physical_experts}) must be divisible by num_ranks ({num_ranks})")
    counts = tokens.detach().to("cpu", torch.float64)
    if not torch.isfinite(counts).all():
        raise ValueError("tokens must be finite (found NaN or inf)")
    if (counts < 0).any():
        raise ValueError("tokens must be non-negative counts")
    return counts


def rebalance(tokens: Tensor, num_ranks: int, num_physical_experts: int) -> Placement:
    """Replicate the hottest experts into the extra slots, then place all replicas on ranks.

    tokens: [steps, layers, experts] windowed per-step token counts per logical expert."""
    counts = validate(tokens, num_ranks, num_physical_experts).permute(1, 0, 2).contiguous()  # [L, S, E]
    replicas, replica_counts = replicate(counts, num_physical_experts - counts.shape[2])
    p2l = place(counts, replicas, replica_counts, num_ranks)
    p2l = refine_by_swaps(counts, p2l, replica_counts, num_ranks)
    return Placement.from_physical_to_logical(p2l, counts.shape[2])


def max_of_others(load: Tensor) -> Tensor:
    """[L, S, E] -> for each e, the per-step maximum over every expert but e (top-2 instead of E maxima)."""
    if load.shape[2] == 1:
        return torch.zeros_like(load)  # loads are >= 0, so an empty maximum can be 0
    top = load.topk(2, dim=2)
    is_top = top.indices[..., :1] == torch.arange(load.shape[2])
    return torch.where(is_top, top.values[..., 1:], top.values[..., :1])


def replicate(counts: Tensor, num_extra: int) -> tuple[Tensor, Tensor]:
    """Greedy, one replica per round: give it to the expert whose extra replica most lowers the windowed
    sum of the per-step maximum per-replica load. counts: [L, S, E] float64.

    Returns (replica expert per physical replica [L, E + num_extra], replica counts [L, E]); the first E
    replicas are the experts themselves, extras follow in the order they were chosen."""
    layers, _, experts = counts.shape
    tie = torch.arange(experts, dtype=torch.float64) * TIE_BREAK
    replica_counts = torch.ones(layers, experts, dtype=torch.int64)
    extras = torch.empty(layers, num_extra, dtype=torch.int64)
    rows = torch.arange(layers)
    for r in range(num_extra):
        n = replica_counts[:, None, :].to(torch.float64)
        load = counts / n + tie
        grown = counts / (n + 1) + tie  # every candidate's load if it got the replica
        score = torch.maximum(max_of_others(load), grown).sum(1)  # [L, E]
        pick = score.argmin(1)  # first minimum: lowest expert on exact ties
        replica_counts[rows, pick] += 1
        extras[:, r] = pick
    base = torch.arange(experts).expand(layers, experts)
    return torch.cat([base, extras], 1), replica_counts


def place(counts: Tensor, replicas: Tensor, replica_counts: Tensor, num_ranks: int) -> Tensor:
    """Greedy: heaviest replica first, onto the non-full rank that least raises the windowed sum of the
    per-step slowest rank's load. Returns physical_to_logical [L, P]."""
    layers, steps, _ = counts.shape
    physical = replicas.shape[1]
    capacity = physical // num_ranks
    rows = torch.arange(layers)
    # Per-step load of each replica: its expert's tokens split evenly over the expert's replicas.
    share = replica_counts.gather(1, replicas).to(torch.float64)
    replica_load = counts.gather(2, replicas[:, None, :].expand(layers, steps, physical)) / share[:, None, :]
    order = replica_load.sum(1).sort(dim=1, descending=True, stable=True).indices
    replica_load = replica_load.transpose(1, 2)  # [L, P, S]: one replica's steps contiguous
    rank_load = torch.zeros(layers, num_ranks, steps, dtype=torch.float64)
    filled = torch.zeros(layers, num_ranks, dtype=torch.int64)
    p2l = torch.empty(layers, physical, dtype=torch.int64)
    for k in range(physical):
        rep = order[:, k]
        load = replica_load[rows, rep]  # [L, S]
        peak = rank_load.amax(1, keepdim=True)
        cost = torch.maximum(peak, rank_load + load[:, None, :]).sum(2)  # [L, R]
        cost.masked_fill_(filled >= capacity, float("inf"))
        rank = cost.argmin(1)  # first minimum: lowest rank on ties
        rank_load[rows, rank] += load
        p2l[rows, rank * capacity + filled[rows, rank]] = replicas[rows, rep]
        filled[rows, rank] += 1
    return p2l


# Rounds of swap refinement per layer: each costs one [capacity, P - capacity, steps] evaluation; the first few
# rounds take almost all of the gain (benchmarks/eplb.json).
SWAP_ROUNDS = 16


def refine_by_swaps(counts: Tensor, p2l: Tensor, replica_counts: Tensor, num_ranks: int,
                    rounds: int = SWAP_ROUNDS) -> Tensor:
    """Local search after the greedy placement: exchange a replica of the rank that is most often the slowest
    with a replica of another rank, when that lowers the windowed sum of the per-step slowest rank's load; the
    best such swap per round, until none helps. The objective never rises, so the result is never worse than
    the greedy one. counts: [L, S, E]; p2l: [L, P] (changed copy returned)."""
    layers, steps, _ = counts.shape
    physical = p2l.shape[1]
    capacity = physical // num_ranks
    if num_ranks < 2:
        return p2l
    p2l = p2l.clone()
    slot_rank = torch.arange(physical) // capacity
    for layer in range(layers):
        share = replica_counts[layer].gather(0, p2l[layer]).to(torch.float64)
        slot_load = counts[layer][:, p2l[layer]].T / share[:, None]        # [P, S]
        for _ in range(rounds):
            if not _best_swap(slot_load, p2l[layer], slot_rank, num_ranks, capacity):
                break
    return p2l


def _best_swap(slot_load: Tensor, p2l: Tensor, slot_rank: Tensor, num_ranks: int, capacity: int) -> bool:
    """Apply the best improving swap out of a critical rank (in place); False if there is none. Critical ranks are
    tried in order of how often each is the slowest (then the lowest rank): the first with an improving swap wins."""
    rank_load = slot_load.view(num_ranks, capacity, -1).sum(1)              # [R, S]
    peak = rank_load.max(0)
    objective = float(peak.values.sum())
    times_slowest = torch.bincount(peak.indices, minlength=num_ranks)
    for crit in times_slowest.sort(descending=True, stable=True).indices.tolist():
        if times_slowest[crit] == 0:
            break
        swap = _best_swap_from(crit, slot_load, rank_load, slot_rank, capacity, objective)
        if swap is not None:
            a, b = swap
            p2l[[a, b]] = p2l[[b, a]]
            slot_load[[a, b]] = slot_load[[b, a]]
            return True
    return False


def _best_swap_from(crit: int, slot_load: Tensor, rank_load: Tensor, slot_rank: Tensor, capacity: int,
                    objective: float) -> tuple[int, int] | None:
    """The (slot on crit, slot elsewhere) exchange that lowers the objective most, or None."""
    num_ranks = rank_load.shape[0]
    others = rank_load.clone()
    others[crit] = float("-inf")
    top = others.topk(min(2, num_ranks - 1), dim=0)                         # the two slowest ranks but crit
    mine = torch.arange(crit * capacity, (crit + 1) * capacity)
    theirs = torch.cat([torch.arange(0, crit * capacity), torch.arange((crit + 1) * capacity, slot_load.shape[0])])
    la, lb = slot_load[mine][:, None, :], slot_load[theirs][None, :, :]     # [C, 1, S], [1, P-C, S]
    b_rank = slot_rank[theirs]
    new_crit = rank_load[crit] - la + lb
    new_other = rank_load[b_rank][None] - lb + la
    # The slowest of the untouched ranks: the slowest but crit, unless that is b's rank (then the second).
    if top.values.shape[0] > 1:
        rest = torch.where(top.indices[0][None, :] == b_rank[:, None], top.values[1][None, :], top.values[0][None, :])
    else:
        rest = torch.zeros_like(lb[0])
    value = torch.maximum(torch.maximum(new_crit, new_other), rest[None]).sum(2)   # [C, P-C]
    best = int(value.argmin())
    if float(value.view(-1)[best]) >= objective * (1 - 1e-9):
        return None
    return int(mine[best // len(theirs)]), int(theirs[best % len(theirs)])


def identity_placement(num_layers: int, num_experts: int, num_ranks: int) -> Placement:
    """Expert e alone on rank e // (experts / ranks): the layout before any rebalance."""
    if num_experts % num_ranks:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by num_ranks ({num_ranks})")
    p2l = torch.arange(num_experts).expand(num_layers, num_experts).clone()
    return Placement.from_physical_to_logical(p2l, num_experts)


def rank_loads(tokens: Tensor, placement: Placement, num_ranks: int) -> Tensor:
    """[layers, steps, ranks] tokens each rank processes, a token of expert e split evenly over e's replicas."""
    p2l = placement.physical_to_logical
    layers, physical = p2l.shape
    counts = validate(tokens, num_ranks, physical).permute(1, 0, 2)
    if counts.shape[0] != layers or counts.shape[2] != placement.replica_counts.shape[1]:
        raise ValueError(
            f"tokens [steps, layers, experts] {tuple(tokens.shape)} do not match the placement's "
            f"{layers} layers x {placement.replica_counts.shape[1]} experts"
        )
    steps = counts.shape[1]
    share = placement.replica_counts.gather(1, p2l).to(torch.float64)
    per_slot = counts.gather(2, p2l[:, None, :].expand(layers, steps, physical)) / share[:, None, :]
    return per_slot.view(layers, steps, num_ranks, physical // num_ranks).sum(3)


def balance_ratio(tokens: Tensor, placement: Placement, num_ranks: int) -> float:
    """Σ max-rank load / Σ mean-rank load over steps and layers (1.0 = perfect).

    Summed over layers as well as steps: each MoE layer waits for its own slowest rank."""
    loads = rank_loads(tokens, placement, num_ranks)
    mean = loads.mean(2).sum()
    if mean == 0:
        return 1.0  # no tokens: nothing is imbalanced
    return float(loads.amax(2).sum() / mean)
