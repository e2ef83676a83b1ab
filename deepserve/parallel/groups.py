"""The process groups of a multi-rank engine, from an initialised torch.distributed world.

Layout (deepinfer.md §11, with tensor parallelism added inside a replica):

    global rank = dp_rank * tp + tp_rank          world = dp * tp
    TP group    = the tp consecutive ranks of one data-parallel replica (they see the same tokens)
    DP group    = the ranks with the same tp_rank in every replica (the step-type votes run here)
    EP group    = a block of ep consecutive ranks, whole TP groups (ep % tp == 0): a MoE layer's experts are spread
                  over it and tokens are dispatched to the rank holding their expert

`torch.distributed.new_group` must be entered by every rank for every group, in the same order: `build_parallel_context`
creates all of them on every rank and keeps its own.
"""

from __future__ import annotations

import datetime
import os
import time

from deepserve.config import check_parallel_sizes as check_sizes
from deepserve.layers.rank_group import ParallelContext, RankGroup

# The ranks other than 0 wait for rank 0's next step inside a broadcast (engine/multi_rank_engine.py): an idle
# server leaves them there for as long as no request comes, so the limit is long.
COLLECTIVE_TIMEOUT = datetime.timedelta(days=7)


def init_world(rank: int, world: int, master_addr: str, master_port: int, backend: str = "gloo") -> None:
    """Join the world (the spawned ranks of one host use a TCP store on `master_addr:master_port`)."""
    import torch.distributed as dist
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world, timeout=COLLECTIVE_TIMEOUT)


def init_from_torchrun(backend: str = "gloo") -> tuple[int, int]:
    """Under torchrun (RANK, WORLD_SIZE and the c10d rendezvous's MASTER_ADDR/PORT set): join, return (rank, world)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", timeout=COLLECTIVE_TIMEOUT)
    return dist.get_rank(), dist.get_world_size()


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                  and "LOCAL_RANK" in os.environ)


def build_parallel_context(rank: int, world: int, tp: int = 1, ep: int = 1) -> ParallelContext:
    """Every group of the layout above (entered on every rank in one order); this rank's ParallelContext."""
    check_sizes(world, tp, ep)
    if world == 1:
        return ParallelContext()
    import torch.distributed as dist
    dp = world // tp

    def group_of(blocks: list[list[int]]) -> RankGroup:
        mine = None
        for members in blocks:
            handle = dist.new_group(members, timeout=COLLECTIVE_TIMEOUT) if len(members) > 1 else None
            if rank in members:
                mine = RankGroup(members.index(rank), len(members), handle, tuple(members))
        assert mine is not None
        return mine

    tp_group = group_of([list(range(d * tp, (d + 1) * tp)) for d in range(dp)])
    dp_group = group_of([list(range(t, world, tp)) for t in range(tp)])
    ep_group = group_of([list(range(b * ep, (b + 1) * ep)) for b in range(world // ep)])
    world_group = RankGroup(rank, world, dist.group.WORLD, tuple(range(world)))
    return ParallelContext(tp=tp_group, dp=dp_group, ep=ep_group, world=world_group)


def backend_for(device_type: str) -> str:
    """gloo for CPU tensors (the control messages and votes, and the CPU model's collectives); NCCL for CUDA ones."""
    return "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# After the process group is destroyed: time for gloo's worker threads to drop their last work objects. A thread the
# scheduler left waiting still held the work of a finished collective (an all-reduce, a barrier holding the step's
# gather) when the interpreter began its teardown; freeing the tensors in it then needed the GIL, which a finalizing
# interpreter refuses by ending the thread inside a noexcept destructor: std::terminate, "terminate called without
# an active exception", the process aborted after correct results (cores of tests/engine/torchrun_generate.py,
# 1-3 runs in 12 on a 2-core host with a busy loop beside it). Torch gives no way to join those threads.
GLOO_THREADS_SETTLE_S = 0.1


def destroy_world() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        gloo = dist.get_backend() == "gloo"
        dist.destroy_process_group()
        if gloo:
            time.sleep(GLOO_THREADS_SETTLE_S)
