"""Tokens carried from one decode graph replay to the next (worker/cuda_graph.py, DEEPSERVE_GRAPH_TOKENS): the
static inputs' token sources, the in-graph patch, and whole engines on the CPU through the graph runner's eager
stand-in (tests/worker/eager_graphs.py) against a plain engine."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.kernels.graph_inputs import patch_tokens_ref
from deepserve.sampling_params import SamplingParams as Params
from deepserve.sequence import Sequence
from deepserve.worker.cuda_graph import COLUMNS, StaticDecodeInputs
from deepserve.worker.scheduler_output import ScheduledSequence, SchedulerOutput

from tests.worker.eager_graphs import install_eager_replay_graphs, install_twin_triton_attention, record_carried_steps

BS = 4


def _seq(seq_id: int, num_tokens: int, blocks: list[int]) -> Sequence:
    seq = Sequence(seq_id, str(seq_id), 0, list(range(100, 100 + num_tokens)), Params(), seed=0)
    seq.block_table = blocks
    return seq


def test_carried_rows_get_a_token_source_and_the_others_stay_for_the_caller():
    """Three decodes whose tokens are in flight (position = len(token_ids)) and one known token: seq 7 and 9 are
    carried (rows 2 and 0 of the token buffer), seq 8 is not (the caller patches it); padding rows and the known
    row read the host's token."""
    inputs = StaticDecodeInputs(max_batch=8, max_blocks=4, device=torch.device("cpu"))
    seqs = [_seq(7, 5, [1, 2]), _seq(8, 6, [3, 4]), _seq(5, 9, [5, 6, 7]), _seq(9, 3, [8])]
    out = SchedulerOutput(scheduled=[ScheduledSequence(seqs[0], 5, 1), ScheduledSequence(seqs[1], 6, 1),
                                     ScheduledSequence(seqs[2], 8, 1), ScheduledSequence(seqs[3], 3, 1)])
    inflight = inputs.fill(out, size=8, block_size=BS, carried={7: 2, 9: 0, 11: 1})
    assert inflight == [(1, 8)]
    assert inputs.token_src.tolist() == [2, -1, -1, 0, -1, -1, -1, -1]
    assert inputs.input_ids.tolist()[:4] == [0, 0, 108, 0]
    # Without carried tokens every in-flight row is the caller's and no row has a source.
    assert inputs.fill(out, size=8, block_size=BS) == [(0, 7), (1, 8), (3, 9)]
    assert set(inputs.token_src.tolist()) == {-1}


def test_mapped_inputs_stay_on_the_host_until_the_replay_loads_them():
    """DEEPSERVE_MAPPED_STEP_IO: a fill writes the host buffer of its turn and copies nothing; `load` (the graph's
    first launch) brings that buffer's rows in, the carried rows' ids from the token buffer, the tables unpacked
    from the step's width; rows whose token the caller puts into the token buffer take their own row as source."""
    inputs = StaticDecodeInputs(max_batch=8, max_blocks=4, device=torch.device("cpu"), mapped=True)
    assert inputs.compact
    # Before any fill every host buffer holds padding rows (read block 0, write nothing), as captures leave the
    # copied inputs: what the start-up's timing replays load.
    for turn in (0, 1, None):
        inputs.load(8, turn, torch.arange(8))
        assert inputs.slots.tolist() == [-1] * 8 and inputs.seq_lens.tolist() == [1] * 8
        assert inputs.token_src.tolist() == [-1] * 8 and inputs.input_ids.tolist() == [0] * 8
    inputs.device.zero_()
    seqs = [_seq(7, 5, [1, 2]), _seq(8, 6, [3, 4]), _seq(5, 9, [5, 6, 7])]
    out = SchedulerOutput(scheduled=[ScheduledSequence(seqs[0], 5, 1), ScheduledSequence(seqs[1], 6, 1),
                                     ScheduledSequence(seqs[2], 8, 1)])
    inflight = inputs.fill(out, size=4, block_size=BS, carried={7: 2})
    assert inflight == [(1, 8)] and inputs.turn == 1
    assert inputs.device.abs().sum() == 0                    # nothing copied
    inputs.take_tokens_from_buffer(inflight)
    tokens = torch.tensor([40, 41, 42, 43, 44, 45, 46, 47])
    inputs.load(4, inputs.turn, tokens)
    assert inputs.input_ids.tolist()[:4] == [42, 41, 108, 0]
    assert inputs.positions.tolist()[:4] == [5, 6, 8, 0]
    assert inputs.seq_lens.tolist()[:4] == [6, 7, 9, 1]
    assert inputs.slots.tolist()[:4] == [2 * BS + 1, 4 * BS + 2, 7 * BS + 0, -1]
    assert inputs.block_tables[:4, :3].tolist() == [[1, 2, 0], [3, 4, 0], [5, 6, 7], [0, 0, 0]]
    assert inputs.input_ids[4:].abs().sum() == 0             # rows past the size untouched
    # The next fill takes the other host buffer: the first one stays as the replay in flight left it.
    first = inputs.hosts[1].clone()
    inputs.fill(out, size=4, block_size=BS)
    assert inputs.turn == 0 and torch.equal(inputs.hosts[1], first)


def test_patch_takes_the_source_rows_and_leaves_the_others():
    ids = torch.tensor([5, 6, 7, 8])
    patch_tokens_ref(ids, torch.tensor([-1, 2, 0, -1]), torch.tensor([40, 41, 42]))
    assert ids.tolist() == [5, 42, 40, 8]


def _engine(tiny_llama, monkeypatch, carry: bool, mapped: bool = False, **kw):
    monkeypatch.setenv("DEEPSERVE_GRAPH_TOKENS", "1" if carry else "0")
    llm = LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", block_size=8, async_scheduling=True, **kw)
    install_twin_triton_attention(llm)
    runner = llm.engine.runner
    graphs = install_eager_replay_graphs(llm, [llm.engine.config.scheduler.max_model_len], sizes=(1, 2, 4, 8),
                                         carry_tokens=carry, compact_tables=carry, mapped_io=mapped)
    assert (graphs.tokens is not None) == carry == graphs.inputs.compact and graphs.mapped == mapped
    carried_steps = []
    sample = runner._sample

    def counting(logits, seqs, step, argmax=None, argmax_host=None):
        sample(logits, seqs, step, argmax, argmax_host)
        carried_steps.append(step.carried)
        if mapped and step.carried:     # the host read the graph's own copy of the tokens
            assert step.host.token_ids.data_ptr() in [t.data_ptr() for t in graphs.host_tokens]
    runner._sample = counting
    sources = []            # each decode replay's token sources (rows whose token the replay patches in)
    fill = graphs.inputs.fill

    def recording(out, size, block_size, carried=None):
        inflight = fill(out, size, block_size, carried)
        inputs = graphs.inputs      # the host buffer: mapped graphs load it in the replay
        src = inputs.hosts[inputs.turn][(COLUMNS - 1) * inputs.max_batch:][:size]
        sources.append([(r, s) for r, s in enumerate(src.tolist()) if s >= 0])
        return inflight
    graphs.inputs.fill = recording
    return llm, graphs, carried_steps, sources


@pytest.mark.parametrize("carry,mapped", [(True, False), (False, False), (True, True)],
                         ids=["carry", "plain", "mapped"])
def test_greedy_engine_with_carried_tokens_equals_a_plain_engine(tiny_llama, monkeypatch, carry, mapped):
    """Greedy requests of different lengths (the batch shrinks and its rows move as sequences finish), one asking
    for logprobs for its first steps' batches, and a sampled one: the tokens (and logprobs) equal a plain eager
    engine's; steps without logprobs or sampled rows took the graph's argmax, the others the sampler; no block is
    left allocated. Without DEEPSERVE_GRAPH_TOKENS the graphs carry nothing. (The carrying graphs also take their
    block tables packed at the step's width: DEEPSERVE_COMPACT_BLOCK_TABLES; `mapped`: the replays load their inputs
    from the host buffers and hand the tokens back in host memory, DEEPSERVE_MAPPED_STEP_IO.)"""
    g = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(0, 500, (n,), generator=g).tolist()} for n in (5, 17, 9, 30, 12)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 12, 16, 9, 3)]
    params[3] = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(temperature=0.8, seed=11, max_tokens=5, ignore_eos=True)
    plain = LLM(tiny_llama, skip_tokenizer_init=True, dtype="float32", block_size=8)
    want = plain.generate(prompts + prompts[:1], params + [sampled], use_tqdm=False)
    llm, graphs, carried_steps, sources = _engine(tiny_llama, monkeypatch, carry, mapped)
    got = llm.generate(prompts + prompts[:1], params + [sampled], use_tqdm=False)
    for i, (w, o) in enumerate(zip(want, got)):
        assert o.outputs[0].token_ids == w.outputs[0].token_ids, i
    # (Logprobs of a row batched with other rows: equal up to float32 summation order.)
    for got_lp, want_lp in zip(got[3].outputs[0].logprobs, want[3].outputs[0].logprobs):
        assert got_lp.keys() == want_lp.keys()
        assert all(abs(got_lp[t].logprob - want_lp[t].logprob) < 1e-4 for t in got_lp)
    assert graphs.num_replays > 0
    if carry:
        # Steps with the logprobs or the sampled request took the sampler; once both finished, the argmax, and the
        # next replays patched those tokens in themselves, from moved rows too once sequences finished.
        assert True in carried_steps and False in carried_steps and carried_steps[-1]
        assert any(sources) and any(r != src for rows in sources for r, src in rows)
    else:
        assert True not in carried_steps and not any(sources)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("engine_args", [
    {"max_num_batched_tokens": 16, "max_num_seqs": 5, "enable_chunked_prefill": True},   # prompts beside decodes
    {"kv_cache_memory_bytes": 24 * 1024 * 4, "block_size": 4},                          # preemption in flight
], ids=["chunked", "preemption"])
@pytest.mark.parametrize("mapped", [False, True], ids=["copied", "mapped"])
def test_carried_tokens_through_prompt_steps_and_preemption(tiny_llama, monkeypatch, engine_args, mapped):
    """Greedy requests that arrive in turn (prompt chunks, eager or mixed-graph steps, right after steps that took
    the graph's argmax: their tokens are patched from the graphs' buffer outside the graph) or get preempted while
    a step is in flight, some stopping on a token: tokens and finish reasons equal the plain loop's (block tables
    packed at each step's width, as the batch's longest table grows, then shrinks with preemption)."""
    prompts = [{"prompt_token_ids": [(11 * i + 3 * j) % 200 + 5 for j in range(3 + 5 * i)]} for i in range(10)]
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * i, stop_token_ids=[57, 91] if i % 3 == 2 else None)
              for i in range(10)]
    kw = dict(skip_tokenizer_init=True, dtype="float32", **engine_args)
    plain = LLM(tiny_llama, **kw).generate(prompts, params, use_tqdm=False)
    monkeypatch.setenv("DEEPSERVE_GRAPH_TOKENS", "1")
    llm = LLM(tiny_llama, async_scheduling=True, **kw)
    install_twin_triton_attention(llm)
    mixed = (16,) if "max_num_batched_tokens" in engine_args else ()
    graphs = install_eager_replay_graphs(llm, [llm.engine.config.scheduler.max_model_len], sizes=(1, 2, 4, 8),
                                         mixed_buckets=mixed, carry_tokens=True, compact_tables=True,
                                         mapped_io=mapped)
    carried = record_carried_steps(llm)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in got] == \
        [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in plain]
    assert sum(carried) > 5 and graphs.num_replays > sum(carried) // 2
    if mixed:
        assert graphs.num_mixed_replays > 0
    else:
        assert llm.engine.scheduler.num_preemptions > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
