"""A process group as the layers see it: this process's place in it and the collectives a layer calls.

Layers never create groups (deepserve/parallel/groups.py does, from torch.distributed) and never read globals:
a model gets its `ParallelContext` at load and hands each layer the group it needs. A group of size 1 is the
single-process case; every collective is then the identity, so a layer's code has one path.

Collectives are the same calls on gloo (CPU processes, the tests) and NCCL (GPUs): every rank of a group enters
each one in the same order with tensors of agreeing shapes, or the group hangs; the callers keep that invariant.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class RankGroup:
    """`rank` of `size` in `group` (a torch.distributed ProcessGroup; None when size is 1). `ranks`: the global
    ranks of the members, in group order."""

    rank: int = 0
    size: int = 1
    group: Any = None
    ranks: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size or len(self.ranks) != self.size:
            raise ValueError(f"rank {self.rank} of a group of {self.size} with members {self.ranks}")
        if self.size > 1 and self.group is None:
            raise ValueError("a group of more than one rank needs a torch.distributed process group")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns x."""
        if self.size > 1:
            import torch.distributed as dist
            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            import torch.distributed as dist
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def all_reduce_min(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            import torch.distributed as dist
            dist.all_reduce(x, op=dist.ReduceOp.MIN, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's x (same shape on every rank), in group order."""
        if self.size == 1:
            return x.unsqueeze(0)
        import torch.distributed as dist
        out = x.new_empty((self.size, *x.shape))
        dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)
        return out

    def all_to_all(self, x: torch.Tensor, send_counts: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Rows of x go to the group's ranks in order: the first send_counts[0] rows to rank 0, the next
        send_counts[1] to rank 1, ... Returns (the rows received, concatenated in source-rank order, and how many
        came from each rank). The counts are exchanged first, so the ranks need not know each other's."""
        if self.size == 1:
            return x, list(send_counts)
        import torch.distributed as dist
        send = torch.tensor(send_counts, dtype=torch.int64)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        recv_counts = recv.tolist()
        out = x.new_empty((sum(recv_counts), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_counts, list(send_counts), group=self.group)
        return out, recv_counts

    def all_to_all_back(self, y: torch.Tensor, recv_counts: list[int], send_counts: list[int]) -> torch.Tensor:
        """The reverse of `all_to_all(x, send_counts)` (which returned `recv_counts`): rows computed for the
        received rows go back to where they came from, arriving in x's order."""
        if self.size == 1:
            return y
        import torch.distributed as dist
        out = y.new_empty((sum(send_counts), *y.shape[1:]))
        dist.all_to_all_single(out, y.contiguous(), list(send_counts), list(recv_counts), group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """`obj` of group rank `src`, on every rank (pickled; for small control messages, not tensors)."""
        if self.size == 1:
            return obj
        import torch.distributed as dist
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.size > 1:
            import torch.distributed as dist
            dist.barrier(group=self.group)

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's `obj` in group order on group rank `dst`; None on the others (pickled; small messages)."""
        if self.size == 1:
            return [obj]
        import torch.distributed as dist
        out = [None] * self.size if self.rank == dst else None
        dist.gather_object(obj, out, dst=self.ranks[dst], group=self.group)
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Group rank `src`'s x into x on every rank, in place; returns x."""
        if self.size > 1:
            import torch.distributed as dist
            dist.broadcast(x, src=self.ranks[src], group=self.group)
        return x


SINGLE = RankGroup()


@dataclass(frozen=True)
class ParallelContext:
    """The groups of one process (global rank = dp_rank * tp + tp_rank):

    - `tp`: the tensor-parallel group, consecutive ranks that hold shards of the same replica's dense weights and
      attention heads and see the same tokens;
    - `dp`: the ranks with this tp rank in every data-parallel replica (each replica is an engine of its own);
    - `ep`: the expert-parallel group, a block of consecutive ranks (whole TP groups) over which each MoE layer's
      experts are spread; tokens are dispatched to the rank holding their expert;
    - `world`: every rank."""

    tp: RankGroup = field(default_factory=lambda: SINGLE)
    dp: RankGroup = field(default_factory=lambda: SINGLE)
    ep: RankGroup = field(default_factory=lambda: SINGLE)
    world: RankGroup = field(default_factory=lambda: SINGLE)

    @property
    def is_single(self) -> bool:
        return self.world.size == 1


__all__ = ["ParallelContext", "RankGroup", "SINGLE"]
