"""An engine of several ranks (tensor, data and expert parallelism), behind LLMEngine's interface.

One process per rank. Rank 0 is the front: it validates and places requests and holds data-parallel replica 0's
tensor-parallel rank 0 (an LLMEngine of its own); `LLM` and the server drive it exactly like a one-process engine.
The other ranks run `serve_rank`: spawned on this host (default), or started by torchrun on several hosts, where
every process runs the same entry point and only rank 0 returns from `LLM(...)`.

One step, every rank, in this order (so that every rank enters every collective the others enter):
  1. rank 0 broadcasts the commands since the last step (requests to add, with the replica each goes to; aborts;
     stop) over the world;
  2. every rank applies the commands of its replica, in order: the ranks of a tensor-parallel group stay identical
     engines (same requests, same order, same scheduling; tp rank 0's sampled tokens are broadcast to them);
  3. every rank runs `LLMEngine.step` (the data-parallel replicas vote on the step's kind there, and a replica with
     nothing to do runs a placeholder forward when experts are spread across replicas);
  4. the tp-rank-0 rank of every replica sends its outputs and stats to rank 0 (a gather over the world).
When rank 0 has nothing to do it stops stepping, and the other ranks wait in step 1's broadcast (no CPU spent).

A request goes to the replica with the fewest unfinished requests (ties: the lowest replica).
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Iterable, NoReturn

import torch

from deepserve.config import EngineArgs, EngineConfig
from deepserve.engine.engine import EngineStats, LLMEngine, Prompt
from deepserve.engine.startup_heap import freeze_startup_heap
from deepserve.layers.rank_group import ParallelContext
from deepserve.outputs import RequestOutput
from deepserve.parallel import groups
from deepserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class StepCommands:
    """What rank 0 broadcasts before a step."""

    adds: list[tuple[int, str, dict, SamplingParams, float | None, bool]] = field(default_factory=list)
    aborts: list[tuple[int, list[str]]] = field(default_factory=list)      # (replica, request ids)
    reset_prefix_cache: bool = False
    stop: bool = False


def create_engine(args: EngineArgs) -> "LLMEngine | MultiRankEngine":
    """The engine `args` ask for: one process, or several ranks."""
    if args.parallel_config.world_size == 1:
        return LLMEngine.from_engine_args(args)
    return MultiRankEngine(args)


def serve_if_worker_rank(args: EngineArgs) -> None:
    """Under torchrun, a rank other than 0 serves rank 0 until it stops, then exits the process. Rank 0 (and a
    plain process) returns at once. Called at the top of entry points, before they build anything else."""
    if args.parallel_config.world_size == 1 or not groups.launched_by_torchrun():
        return
    if int(os.environ.get("RANK", "0")) == 0:
        return
    _serve_then_exit(args, *_join_torchrun(args))


def _serve_then_exit(args: EngineArgs, rank: int, world: int) -> NoReturn:
    """A torchrun rank other than 0: serve rank 0 until it stops, tear the process group down, end the process.
    It ends with os._exit, past the interpreter's teardown, where a gloo thread still destroying a collective's work
    aborted the process now and then ("terminate called without an active exception": 3 runs in 12 of
    tests/engine/torchrun_generate.py on a loaded 2-core host, after correct tokens; groups.GLOO_THREADS_SETTLE_S
    says why), which fails the torchrun job. The rank holds nothing a teardown would save: its engine served its
    last step, its output streams are flushed."""
    try:
        serve_rank(args, rank, world)
    finally:
        groups.destroy_world()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class MultiRankEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        pc = args.parallel_config
        self.world_size, self.tp_size, self.dp_size = pc.world_size, pc.tensor_parallel_size, pc.data_parallel_size
        self._procs: list[multiprocessing.Process] = []
        self._commands = StepCommands()
        self._replica_of: dict[str, int] = {}          # unfinished request -> replica
        self._load = [0] * self.dp_size                  # unfinished requests per replica
        self._stats: list[EngineStats | None] = [None] * self.dp_size
        self._stopped = False
        self._failure: BaseException | None = None
        if groups.launched_by_torchrun():
            rank, world = _join_torchrun(args)
            if rank != 0:
                _serve_then_exit(args, rank, world)
        else:
            self._spawn_ranks(args)
        try:
            self.local = _build_rank_engine(args, 0, self.world_size)
        except BaseException:
            self._kill_ranks()
            raise
        self.parallel: ParallelContext = self.local.runner.parallel
        atexit.register(self.shutdown)

    # --- start and stop -------------------------------------------------------------------------
    def _spawn_ranks(self, args: EngineArgs) -> None:
        port = groups.free_port()
        ctx = multiprocessing.get_context("spawn")
        for rank in range(1, self.world_size):
            proc = ctx.Process(target=run_spawned_rank, args=(args, rank, self.world_size, port), daemon=True,
                               name=f"deepserve-rank-{rank}")
            proc.start()
            self._procs.append(proc)
        _set_threads(args, self.world_size)
        _set_cuda_device(args, 0)
        groups.init_world(0, self.world_size, "127.0.0.1", port, groups.backend_for(_device_type(args)))

    def shutdown(self) -> None:
        """Stop every rank (they leave their loop at the same broadcast) and release the process group."""
        if self._stopped:
            return
        self._stopped = True
        if self._failure is None:       # after a failed step the ranks wait in another collective: kill them
            try:
                self.parallel.world.broadcast_object(StepCommands(stop=True))
                self.parallel.world.barrier()     # nobody tears the group down while another still uses it
            except Exception:           # noqa: BLE001 - a rank already gone: terminate what is left below
                logger.warning("multi-rank engine: stopping the ranks failed; terminating them")
            for proc in self._procs:
                proc.join(timeout=10)
        self._kill_ranks()
        groups.destroy_world()

    def _kill_ranks(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)

    # --- LLMEngine's interface --------------------------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        return self.local.config

    @property
    def tokenizer(self):
        return self.local.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.local.vocab_size

    @property
    def grammar_compiler(self):
        return self.local.grammar_compiler

    @property
    def kv_store(self):
        return None

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, final_output_only: bool = False) -> None:
        """Validate here (ValueError, nothing queued), then queue for the least-loaded replica's next step."""
        params = params or SamplingParams()
        if request_id in self._replica_of:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = self.local.prepare_request(prompt, params)
        replica = min(range(self.dp_size), key=lambda r: (self._load[r], r))
        self._replica_of[request_id] = replica
        self._load[replica] += 1
        self._commands.adds.append((replica, request_id, {"prompt": text, "prompt_token_ids": ids}, params,
                                    arrival_time, final_output_only))

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        by_replica: dict[int, list[str]] = {}
        for request_id in ids:
            replica = self._replica_of.pop(request_id, None)
            if replica is not None:
                self._load[replica] -= 1
                by_replica.setdefault(replica, []).append(request_id)
        self._commands.aborts.extend(by_replica.items())

    def has_unfinished_requests(self) -> bool:
        """Unfinished requests, or commands the ranks have not seen yet (an abort of the last request still has to
        reach its replica, which holds its blocks until then)."""
        c = self._commands
        return bool(self._replica_of or c.adds or c.aborts or c.reset_prefix_cache)

    def get_num_unfinished_requests(self) -> int:
        return len(self._replica_of)

    def reset_prefix_cache(self) -> None:
        self._commands.reset_prefix_cache = True

    def step(self) -> list[RequestOutput]:
        if self._failure is not None:
            # The ranks are somewhere inside a step that rank 0 left: no further collective can match.
            raise RuntimeError(f"the multi-rank engine failed in an earlier step ({self._failure!r}); "
                               "shut it down and start a new one") from self._failure
        commands, self._commands = self._commands, StepCommands()
        try:
            self.parallel.world.broadcast_object(commands)
            results = _run_step(self.local, commands, replica=0, tp_rank=0, world=self.parallel.world)
        except BaseException as error:
            self._failure = error
            raise
        outputs = []
        for replica_result in results:
            if replica_result is None:
                continue
            replica, replica_outputs, stats = replica_result
            self._stats[replica] = stats
            for out in replica_outputs:
                if out.request_id not in self._replica_of:
                    continue                # aborted here after the replica produced it
                if out.finished:
                    del self._replica_of[out.request_id]
                    self._load[replica] -= 1
                outputs.append(out)
        return outputs

    def get_stats(self) -> EngineStats:
        """The replicas' stats as of their last step, summed (usage and moe_lb: the mean and the worst)."""
        known = [s for s in self._stats if s is not None] or [self.local.get_stats()]
        total = {f.name: 0 for f in dataclasses.fields(EngineStats)}
        for stats in known:
            for f in dataclasses.fields(EngineStats):
                value = getattr(stats, f.name)
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    total[f.name] += value
        total["kv_cache_usage"] = sum(s.kv_cache_usage for s in known) / len(known)
        lbs = [s.moe_lb for s in known if s.moe_lb is not None]
        total["moe_lb"] = max(lbs) if lbs else None
        total["kv_store"] = None
        return EngineStats(**total)


# --- every rank's side ----------------------------------------------------------------------------
def run_spawned_rank(args: EngineArgs, rank: int, world: int, port: int) -> None:
    """Entry point of a rank spawned on this host."""
    try:
        _set_threads(args, world)
        _set_cuda_device(args, rank)
        groups.init_world(rank, world, "127.0.0.1", port, groups.backend_for(_device_type(args)))
        serve_rank(args, rank, world)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        groups.destroy_world()


def serve_rank(args: EngineArgs, rank: int, world: int) -> None:
    """A rank other than 0: build its engine, then step whenever rank 0 does, until it says stop."""
    engine = _build_rank_engine(args, rank, world)
    freeze_startup_heap()               # the rank's process lives as long as its engine
    parallel = engine.runner.parallel
    replica, tp_rank = rank // args.tensor_parallel_size, rank % args.tensor_parallel_size
    while True:
        commands: StepCommands = parallel.world.broadcast_object(None)
        if commands.stop:
            parallel.world.barrier()              # rank 0's shutdown waits here too
            return
        _run_step(engine, commands, replica, tp_rank, parallel.world)


def _run_step(engine: LLMEngine, commands: StepCommands, replica: int, tp_rank: int, world) -> list | None:
    """Steps 2-4 of the module docstring on one rank; rank 0 gets every replica's (replica, outputs, stats)."""
    for r, request_id, prompt, params, arrival, final_only in commands.adds:
        if r == replica:
            engine.add_request(request_id, prompt, params, arrival, final_output_only=final_only)
    for r, request_ids in commands.aborts:
        if r == replica:
            engine.abort_request(request_ids)
    if commands.reset_prefix_cache:
        engine.block_manager.reset_prefix_cache()
    outputs = engine.step()
    mine = (replica, outputs, engine.get_stats()) if tp_rank == 0 else None
    return world.gather_object(mine)


def _build_rank_engine(args: EngineArgs, rank: int, world: int) -> LLMEngine:
    pc = args.parallel_config
    context = groups.build_parallel_context(rank, world, pc.tensor_parallel_size, pc.expert_parallel_size)
    return LLMEngine(args.create_engine_config(), parallel=context)


def _join_torchrun(args: EngineArgs) -> tuple[int, int]:
    _set_cuda_device(args, int(os.environ.get("LOCAL_RANK", "0")))
    rank, world = groups.init_from_torchrun(groups.backend_for(_device_type(args)))
    expected = args.parallel_config.world_size
    if world != expected:
        raise ValueError(f"torchrun started {world} processes but data_parallel_size x tensor_parallel_size is "
                         f"{expected}")
    return rank, world


def _device_type(args: EngineArgs) -> str:
    if args.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if args.device.startswith("cuda") else "cpu"


def _set_cuda_device(args: EngineArgs, local_rank: int) -> None:
    if _device_type(args) == "cuda":
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


def _set_threads(args: EngineArgs, world: int) -> None:
    """CPU ranks of one host share its cores: each gets its part, so that they do not oversubscribe them."""
    if _device_type(args) == "cpu" and not groups.launched_by_torchrun():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))


__all__ = ["MultiRankEngine", "create_engine", "serve_if_worker_rank", "serve_rank"]
