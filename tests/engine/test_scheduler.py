"""Scheduler policy: token budget, chunked prefill, preemption order, watermark, ignored sequences."""

from __future__ import annotations

from deepserve.config import SchedulerConfig
from deepserve.engine.block_manager import BlockManager
from deepserve.engine.scheduler import Scheduler
from deepserve.sequence import Sequence, SequenceStatus
from deepserve.sampling_params import SamplingParams

BS = 4


def make(num_blocks=32, budget=16, max_seqs=8, chunked=True, watermark=0.0):
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=256,
                          enable_chunked_prefill=chunked, watermark=watermark)
    return Scheduler(cfg, BlockManager(num_blocks, BS))


_ids = iter(range(1, 10**6))


def seq(n_tokens, first=1):
    return Sequence(next(_ids), "r", 0, list(range(first, first + n_tokens)), SamplingParams(), seed=0)


def finish_step(sched, out, sampled=7):
    """Pretend the forward ran: sequences that sampled get one more token."""
    for s in out.scheduled:
        if s.samples:
            s.seq.append_token(sampled)
        sched.commit(s.seq)


def test_long_prompt_is_chunked_and_mixed_with_decodes():
    sched = make(budget=16)
    a = seq(5)
    sched.add(a)
    finish_step(sched, sched.schedule())
    b = seq(40, first=100)
    sched.add(b)
    out = sched.schedule()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 15)]
    assert not out.scheduled[1].samples
    finish_step(sched, out)
    out = sched.schedule()
    assert [(s.seq, s.start, s.num_new_tokens) for s in out.scheduled] == [(a, 6, 1), (b, 15, 15)]


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    sched = make(budget=16, chunked=False)
    a, b = seq(10), seq(10, first=50)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [a]


def test_preempts_latest_admitted_and_requeues_it_first():
    sched = make(num_blocks=4, budget=64)
    a, b = seq(8), seq(8, first=20)       # 2 full blocks each: the cache is full
    sched.add(a)
    sched.add(b)
    finish_step(sched, sched.schedule())   # now 9 tokens each; token 9 needs a 3rd block
    out = sched.schedule()
    assert out.preempted == [b]
    assert [s.seq for s in out.scheduled] == [a]
    assert b.status is SequenceStatus.WAITING and sched.waiting[0] is b and b.block_table == []
    assert b.num_computed_tokens == 0 and b.num_tokens == 9   # recomputed later from its tokens


def test_sequence_that_never_fits_is_ignored():
    sched = make(num_blocks=2)
    big = seq(20)
    sched.add(big)
    out = sched.schedule()
    assert out.ignored == [big] and big.status is SequenceStatus.FINISHED_IGNORED and big.error


def test_watermark_holds_back_admissions_but_not_the_first():
    sched = make(num_blocks=10, budget=64, watermark=0.3)   # keep 3 blocks free when others run
    a = seq(20)
    sched.add(a)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [a]           # 5 blocks, alone: admitted
    finish_step(sched, out)
    b = seq(12, first=40)                                   # 3 blocks: 5 free - 3 < 3 reserved
    sched.add(b)
    out = sched.schedule()
    assert [s.seq for s in out.scheduled] == [a]


def test_max_num_seqs_caps_running():
    sched = make(max_seqs=2, budget=64)
    seqs = [seq(3, first=10 * i + 1) for i in range(3)]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert len(out.scheduled) == 2 and sched.num_waiting == 1


def test_finish_frees_blocks():
    sched = make()
    a = seq(9)
    sched.add(a)
    sched.schedule()
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    assert sched.block_manager.num_free_blocks == 32 and not sched.has_unfinished()
