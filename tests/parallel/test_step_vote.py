"""The DP step-type votes (deepserve/parallel/step_vote.py): the cadence on one rank, and on 2 and 4 gloo processes
with skewed loads (one rank idle, one overloaded, prompts arriving mid-decode, a rank whose prompts never fit) every
rank takes the same kind of step at every step, nobody waits in a collective forever, every request finishes."""

from __future__ import annotations

import datetime
import random
import socket

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from deepserve.parallel.step_vote import ALL_INTERVAL, ANY_INTERVAL, StepKind, StepVote, gloo_allreduce_min, wants_prompt


def one_rank() -> StepVote:
    return StepVote(lambda v: v)


def test_back_to_back_prompt_steps_while_work_remains_then_the_all_cadence():
    vote = one_rank()
    kinds = [vote.decide(True, lambda: ["p"]).kind for _ in range(3)]
    assert kinds == [StepKind.PROMPT] * 3                  # decode_step stays 0: prompts keep coming
    kinds = [vote.decide(False, lambda: None).kind for _ in range(ALL_INTERVAL + 1)]
    assert kinds == [StepKind.DECODE] * (ALL_INTERVAL + 1)
    # decode_step is now 71: the next vote is the ANY point at 100 (before the ALL point at 140).
    kinds = [vote.decide(True, lambda: ["p"]).kind for _ in range(ANY_INTERVAL - ALL_INTERVAL)]
    assert kinds[-1] is StepKind.PROMPT and set(kinds[:-1]) == {StepKind.DECODE}


def test_a_wanted_prompt_that_cannot_be_scheduled_means_decode():
    vote = one_rank()
    decision = vote.decide(True, lambda: None)           # wanted, but nothing fit: the second vote says decode
    assert decision.kind is StepKind.DECODE and vote.decode_step == 1


def test_wants_prompt_respects_the_kv_watermark():
    assert wants_prompt(0.5, True) and not wants_prompt(0.95, True) and not wants_prompt(0.1, False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, arrivals: dict, fits: dict, steps: int, out) -> None:
    """A toy DP rank: prompts arrive at given steps, a prompt step admits up to 2 (if they fit), each running
    request decodes for 5 steps. Records the kind of every step."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    vote = StepVote(gloo_allreduce_min())
    waiting, running, done, kinds = [], [], 0, []
    for step in range(steps):
        waiting += [f"r{rank}-{step}-{i}" for i in range(arrivals[rank].get(step, 0))]

        def schedule():
            if not fits[rank]:
                return None
            admitted = waiting[:2]
            del waiting[:2]
            return admitted or None
        decision = vote.decide(wants_prompt(0.2, bool(waiting)), schedule)
        kinds.append(decision.kind.value)
        if decision.kind is StepKind.PROMPT:
            running += [[r, 5] for r in (decision.prompts or [])]
        else:
            for r in running:
                r[1] -= 1
            done += sum(1 for r in running if r[1] == 0)
            running = [r for r in running if r[1] > 0]
    gathered = [None] * world
    dist.all_gather_object(gathered, kinds)
    if rank == 0:
        out.put(gathered)
    out.put((rank, done, len(waiting), len(running)))
    dist.destroy_process_group()


@pytest.mark.parametrize("world, stuck", [(2, False), (4, False), (3, True)])
def test_ranks_agree_on_every_step_under_skewed_loads(world, stuck):
    """`stuck`: the last rank wants prompt steps but can never schedule its prompts (they never fit): the others'
    prompt steps still happen (it runs placeholder prompt steps), and its own requests just wait."""
    rng = random.Random(world)
    arrivals = {0: {0: 6, 150: 3}, 1: {}}                 # rank 0 overloaded, rank 1 idle
    for r in range(2, world):
        arrivals[r] = {rng.randrange(1, 300): 1 for _ in range(4)}   # prompts arriving mid-decode
    fits = {r: not (stuck and r == world - 1) for r in range(world)}
    steps = 600
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, arrivals, fits, steps, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = [out.get(timeout=120) for _ in range(world + 1)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    kinds = next(r for r in results if isinstance(r, list))
    assert all(k == kinds[0] for k in kinds)               # the same step kind on every rank, every step
    assert kinds[0].count("prompt") >= 3
    counts = {r[0]: r[1:] for r in results if isinstance(r, tuple)}
    total = {r: sum(arrivals[r].values()) for r in range(world)}
    for r in range(world):
        want = (total[r], 0, 0) if fits[r] else (0, total[r], 0)
        assert counts[r] == want, (r, counts[r])
