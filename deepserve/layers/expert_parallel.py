"""Expert parallelism for FusedMoE: the routed experts spread over an EP group, tokens dispatched to them and back.

Placement (deepinfer.md §7): a layer has P physical expert slots (E logical experts + redundant replicas, P divisible
by the EP size); rank i of the EP group holds slots [i * L, (i + 1) * L), L = P / ep.size. Three maps name where
each logical expert lives (`deepserve.eplb.Placement`): physical_to_logical [P], logical_to_physical [E, max_replicas]
(-1 padded) and replica_counts [E].

After `enable_expert_parallel`, a layer's `w13` / `w2` Parameters ARE this rank's local stacks ([L, 2I, H] and
[L, H, I], local slot order), so the expert backend (reference or GPU kernel, quantization if it comes later) sees
L experts and the full stacks' memory is freed. The gate still routes over all E logical experts and
`FusedMoE.expert_load` still counts every row the gate saw, on every TP rank: summed over an EP group it counts each
token tp times (the engine divides by tp).

Dispatch / combine invariants of `ExpertParallelMoE.forward`:
- The ranks of one TP group see the same tokens; row r is dispatched only by TP rank r % tp.size (its "owner"), so
  every (row, expert) pair is computed exactly once. A non-owner's routed output for r is 0 here; FusedMoE's own
  tp.all_reduce sums the shares. `shared` is already this rank's TP partial (the shared experts are TP-sharded), so
  it is added on every rank as it is.
- A pair goes to a replica chosen by (row + j) % replica_counts[e]: deterministic, and spreads a hot expert's pairs
  over its replicas. The replica changes which rank computes a pair, never its result.
- Every rank of the EP group enters both all-to-alls every forward, with zero rows too (an idle rank's placeholder
  step): collectives must match across ranks or the group hangs.
- The receiver applies the routing weight (ids [R, 1] = local slot, weights [R, 1]); the source sums the k weighted
  outputs of a row in float32 with `shared` and rounds to x's dtype once, as the single-process backend does.
"""

from __future__ import annotations

import torch
from torch import nn

from deepserve.eplb import Placement
from deepserve.layers.moe import FusedMoE
from deepserve.layers.rank_group import RankGroup

_PLAIN_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class ExpertParallelMoE(nn.Module):
    """The EP state of one FusedMoE (stored in `layer.expert_parallel`): groups and placement maps. A Module so that
    the maps (non-persistent buffers) move with the model to its device; they are updated in place, never
    reassigned, so captured CUDA graphs keep reading the live maps."""

    def __init__(self, ep: RankGroup, tp: RankGroup, num_experts: int, physical_to_logical: torch.Tensor,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.ep, self.tp = ep, tp
        self.num_experts = num_experts
        self.num_physical = physical_to_logical.numel()
        self.num_local = self.num_physical // ep.size
        placement = Placement.from_physical_to_logical(physical_to_logical.view(1, -1).cpu(), num_experts)
        self.register_buffer("physical_to_logical", placement.physical_to_logical[0].to(device), persistent=False)
        self.register_buffer("logical_to_physical", placement.logical_to_physical[0].to(device), persistent=False)
        self.register_buffer("replica_counts", placement.replica_counts[0].to(device), persistent=False)

    def local_slots(self, rank: int | None = None) -> slice:
        """The physical slots EP rank `rank` (default: this one) holds."""
        rank = self.ep.rank if rank is None else rank
        return slice(rank * self.num_local, (rank + 1) * self.num_local)

    def set_placement(self, physical_to_logical: torch.Tensor) -> None:
        placement = Placement.from_physical_to_logical(physical_to_logical.view(1, -1).cpu(), self.num_experts)
        self.physical_to_logical.copy_(placement.physical_to_logical[0])
        self.logical_to_physical.copy_(placement.logical_to_physical[0])
        self.replica_counts.copy_(placement.replica_counts[0])

    def forward(self, layer: FusedMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                shared: torch.Tensor | None) -> torch.Tensor:
        """x [T, H], weights [T, k] float32, ids [T, k] logical experts, shared None or [T, H] -> [T, H] in x's
        dtype: this rank's share of the routed sum (its owned rows) plus `shared`."""
        t, hidden = x.shape
        k = ids.shape[1]
        rows = torch.arange(t, device=x.device)
        rows = rows[rows % self.tp.size == self.tp.rank]                  # the rows this TP rank dispatches
        pair_row = rows.repeat_interleave(k)                              # pair = (owned row, j), row-major
        pair_j = torch.arange(k, device=x.device).repeat(rows.numel())
        expert = ids[pair_row, pair_j]
        replica = (pair_row + pair_j) % self.replica_counts[expert]
        slot = self.logical_to_physical[expert, replica]
        dest = slot // self.num_local
        order = torch.argsort(dest, stable=True)                         # all_to_all sends rows by destination
        pair_row, dest = pair_row[order], dest[order]
        send_counts = torch.bincount(dest, minlength=self.ep.size).tolist()
        packed = _pack(x[pair_row], weights[pair_row, pair_j[order]], slot[order] % self.num_local)

        received, recv_counts = self.ep.all_to_all(packed, send_counts)
        h, w, local = _unpack(received, hidden)
        if h.shape[0]:
            y = layer.backend.forward(h, layer.w13, layer.w2, w[:, None], local[:, None], layer.swiglu_limit)
        else:       # nothing received: no expert kernel launch (the collectives around it still run)
            y = h
        back = self.ep.all_to_all_back(y, recv_counts, send_counts)

        out = torch.zeros(t, hidden, dtype=torch.float32, device=x.device)
        out.index_add_(0, pair_row, back.float())
        if shared is not None:
            out += shared.float()
        return out.to(x.dtype)


# A pair's routing weight (float32) and local slot (int32) travel in the same all_to_all as its hidden row: their
# 8 bytes reinterpreted as x's dtype and appended to the row (bit-exact), so one collective carries everything.
def _pack(h: torch.Tensor, weight: torch.Tensor, local_slot: torch.Tensor) -> torch.Tensor:
    meta = torch.stack([weight.float().view(torch.int32), local_slot.to(torch.int32)], dim=1)
    return torch.cat([h, meta.view(h.dtype)], dim=1)


def _unpack(packed: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    meta = packed[:, hidden:].contiguous().view(torch.int32)
    return packed[:, :hidden].contiguous(), meta[:, 0].contiguous().view(torch.float32), meta[:, 1].long()


def enable_expert_parallel(moe_layers: list[FusedMoE], ep: RankGroup, tp: RankGroup,
                           num_physical_experts: int) -> None:
    """Spread each layer's experts over `ep` (called on every EP rank, after the weights are loaded): initial
    placement slot p -> logical p % E; the layer keeps only its local slots' weights (its w13 / w2 become the
    [L, ...] stacks) and dispatches its routed tokens through `ExpertParallelMoE`."""
    if ep.size % tp.size:
        raise ValueError(f"expert_parallel_size {ep.size} must be a multiple of tensor_parallel_size {tp.size}")
    for i, layer in enumerate(moe_layers):
        num_experts = layer.num_experts
        if num_physical_experts < num_experts or num_physical_experts % ep.size:
            raise ValueError(f"num_physical_experts {num_physical_experts} (experts {num_experts} + "
                             f"num_redundant_experts {num_physical_experts - num_experts}) must be >= the number of "
                             f"experts and divisible by expert_parallel_size {ep.size}")
        if layer.expert_parallel is not None:
            raise ValueError(f"MoE layer {i}: expert parallelism is already enabled")
        for name in ("w13", "w2"):
            w = getattr(layer, name)
            if type(w) is not nn.Parameter or w.dtype not in _PLAIN_FLOATS or w.shape[0] != num_experts:
                raise ValueError(f"MoE layer {i}: expert parallelism needs {name} as a plain float Parameter "
                                 f"[{num_experts}, ...], got {type(w).__name__} {w.dtype} {tuple(w.shape)} "
                                 "(quantized or already sharded experts are not supported)")
        p2l = torch.arange(num_physical_experts) % num_experts
        state = ExpertParallelMoE(ep, tp, num_experts, p2l, device=layer.w13.device)
        local = p2l[state.local_slots()].to(layer.w13.device)
        layer.w13 = nn.Parameter(layer.w13.data[local].clone(), requires_grad=layer.w13.requires_grad)
        layer.w2 = nn.Parameter(layer.w2.data[local].clone(), requires_grad=layer.w2.requires_grad)
        layer.expert_parallel = state


def move_experts(layer: FusedMoE, new_physical_to_logical: torch.Tensor) -> None:
    """Re-place one layer's experts (deepinfer.md §7, weight shuffle): every EP rank calls this with the same new
    map [P] (from `deepserve.eplb.rebalance`, deterministic). A new local slot whose expert this rank already held
    is copied locally; the others are received from a rank that held it (holders taken round-robin per expert),
    by P2P ops all posted before any is waited on. Then the maps are replaced. The weights and maps are updated in
    place (same storage), so backends and captured graphs keep valid pointers."""
    state: ExpertParallelMoE = layer.expert_parallel
    if state is None:
        raise ValueError("move_experts: expert parallelism is not enabled on this layer")
    old = state.physical_to_logical.cpu()
    new = new_physical_to_logical.to(torch.int64).cpu().view(-1)
    if new.shape != old.shape or bool(((new < 0) | (new >= state.num_experts)).any()):
        raise ValueError(f"new physical_to_logical must be [{old.numel()}] logical expert ids < {state.num_experts}")
    if bool((torch.bincount(new, minlength=state.num_experts) == 0).any()):
        raise ValueError("new physical_to_logical leaves a logical expert without a replica")

    me, size = state.ep.rank, state.ep.size
    held = [old[state.local_slots(r)].tolist() for r in range(size)]       # each rank's old local experts
    wanted = new[state.local_slots()].tolist()
    sources = {}                                                           # expert -> this rank's new buffer pair
    ops = []
    for dst, (src, expert) in _transfers(held, new.view(size, -1).tolist()):
        if src == me:           # send from my first old slot of that expert
            s = held[me].index(expert)
            ops += _p2p("isend", (layer.w13.data[s], layer.w2.data[s]), state.ep.ranks[dst], state.ep.group, expert)
        if dst == me:
            bufs = (torch.empty_like(layer.w13.data[0]), torch.empty_like(layer.w2.data[0]))
            sources[expert] = bufs
            ops += _p2p("irecv", bufs, state.ep.ranks[src], state.ep.group, expert)
    for work in _post(ops):
        work.wait()

    # New stacks built aside (a local copy must not overwrite an old slot still to be read), then written in place.
    new_w13, new_w2 = torch.empty_like(layer.w13.data), torch.empty_like(layer.w2.data)
    for s, expert in enumerate(wanted):
        if expert in held[me]:
            o = held[me].index(expert)
            new_w13[s], new_w2[s] = layer.w13.data[o], layer.w2.data[o]
        else:
            new_w13[s], new_w2[s] = sources[expert]
    layer.w13.data.copy_(new_w13)
    layer.w2.data.copy_(new_w2)
    state.set_placement(new)


def move_experts_all(moe_layers: list[FusedMoE], placement: Placement) -> None:
    """`move_experts` for every layer, layer i taking `placement.physical_to_logical[i]`."""
    for layer, p2l in zip(moe_layers, placement.physical_to_logical, strict=True):
        move_experts(layer, p2l)


def _transfers(held: list[list[int]], wanted: list[list[int]]) -> list[tuple[int, tuple[int, int]]]:
    """Every remote fetch of the shuffle as (dst rank, (src rank, expert)), in one global order that every rank
    computes identically: once per (rank, expert) the rank lacks, from the expert's old holders round-robin."""
    holders: dict[int, list[int]] = {}
    for rank, experts in enumerate(held):
        for e in dict.fromkeys(experts):
            holders.setdefault(e, []).append(rank)
    turn: dict[int, int] = {}
    plan = []
    for dst, experts in enumerate(wanted):
        for e in dict.fromkeys(experts):                      # a rank fetches an expert once for all its replicas
            if e in held[dst]:
                continue
            n = turn.get(e, 0)
            turn[e] = n + 1
            plan.append((dst, (holders[e][n % len(holders[e])], e)))
    return plan


def _p2p(kind: str, tensors: tuple[torch.Tensor, ...], peer: int, group, expert: int) -> list:
    """P2P ops for one expert's (w13, w2); the tag (unique per expert and tensor) keeps gloo's matching exact, and
    both sides post in the same global order for NCCL, which matches by order."""
    import torch.distributed as dist
    op = dist.isend if kind == "isend" else dist.irecv
    return [dist.P2POp(op, t.contiguous() if kind == "isend" else t, peer, group, tag=2 * expert + i)
            for i, t in enumerate(tensors)]


def _post(ops: list) -> list:
    if not ops:
        return []
    import torch.distributed as dist
    return dist.batch_isend_irecv(ops)


__all__ = ["ExpertParallelMoE", "enable_expert_parallel", "move_experts", "move_experts_all"]
