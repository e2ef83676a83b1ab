"""Run a function on N CPU processes joined in one gloo group, and collect each rank's return value.

    results = run_ranks(fn, world_size, *args, timeout=120)      # results[r] = fn(rank=r, world=world_size, *args)

`fn` must be importable by the spawned processes (a module-level function of a test module or of this package).
A rank that raises fails the call with its traceback; a rank that is still running at the timeout (a deadlock in
a collective) fails it too, and every process is killed, so a hang never outlives its test.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(fn, rank: int, world: int, port: int, args: tuple, results) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)        # N processes on a 2-core machine: one thread each, no oversubscription
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=90))
        value = fn(rank, world, *args)
        # Pickled to bytes here: a tensor put on the queue as is travels as a shared-memory handle, which is gone
        # if this process exits before the parent unpickles it.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:               # noqa: BLE001 - reported to the parent, which fails the test
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 120.0) -> list:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    env = os.environ.copy()
    procs = [ctx.Process(target=_rank_entry, args=(fn, r, world, port, args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    try:
        while len(got) < world:
            try:
                rank, status, value = results.get(timeout=timeout)
            except queue.Empty:
                missing = sorted(set(range(world)) - set(got))
                raise TimeoutError(f"ranks {missing} still running after {timeout} s (a deadlock?)") from None
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            got[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        os.environ.clear()
        os.environ.update(env)
    return [got[r] for r in range(world)]


def make_groups(rank: int, world: int, tp: int = 1, ep: int = 1):
    """The ParallelContext of `rank` for world = dp * tp (deepserve/parallel/groups.py builds the real one; tests of
    layers below the worker floor use this so that they do not depend on it)."""
    from deepserve.parallel.groups import build_parallel_context
    return build_parallel_context(rank, world, tp, ep)
