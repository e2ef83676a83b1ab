"""Mixed steps (prompt chunks beside decodes) replayed from CUDA graphs (worker/mixed_graph.py): the static layout
of a step, then whole engines on the CPU through the GPU backend's metadata with the kernels' PyTorch twins and the
graph runner's eager stand-in (tests/worker/eager_graphs.py), against a plain engine."""

from __future__ import annotations

import pytest
import torch

from deepserve import LLM, SamplingParams
from deepserve.sampling_params import SamplingParams as Params
from deepserve.sequence import Sequence
from deepserve.worker.mixed_graph import StaticMixedInputs, mixed_buckets
from deepserve.worker.scheduler_output import ScheduledSequence, SchedulerOutput

from tests.worker.eager_graphs import install_eager_replay_graphs, install_twin_triton_attention

BS = 4


def _seq(seq_id: int, num_tokens: int, blocks: list[int]) -> Sequence:
    seq = Sequence(seq_id, str(seq_id), 0, list(range(100, 100 + num_tokens)), Params(), seed=0)
    seq.block_table = blocks
    return seq


def test_buckets():
    assert mixed_buckets(8192) == [256, 512, 1024, 2048]
    assert mixed_buckets(1000) == [256, 512, 1000]
    assert mixed_buckets(256) == [256] and mixed_buckets(100) == []


@pytest.mark.parametrize("compact", [False, True])
def test_a_step_fills_rows_sequences_decodes_tiles_then_padding(compact):
    """A decode (seq 0, position 6), a 5-token chunk over a 3-token prefix (seq 1), a decode whose token is in flight
    (seq 2): rows in order, then padding rows (slot -1); padding sequences without rows; decode entries and tiles
    padded with the padding row / padding sequence; the logits rows are each sequence's last row; the block tables
    the same whether they travel at max_blocks or packed (compact), the padding sequence's row zeros."""
    inputs = StaticMixedInputs(max_tokens=16, max_seqs=4, max_blocks=4, tile_rows=2, device=torch.device("cpu"),
                               compact=compact)
    a, b, c = _seq(1, 7, [5, 6]), _seq(2, 8, [7, 8]), _seq(3, 4, [9, 3])
    out = SchedulerOutput(scheduled=[ScheduledSequence(a, 6, 1), ScheduledSequence(b, 3, 5),
                                     ScheduledSequence(c, 4, 1)])
    inflight = inputs.fill(out, tokens=8, block_size=BS)
    assert inflight == [(6, 3)]                                   # row 6 reads seq 3's token at position 4
    assert inputs.input_ids[:9].tolist() == [106, 103, 104, 105, 106, 107, 0, 0, 0]
    assert inputs.positions[:9].tolist() == [6, 3, 4, 5, 6, 7, 4, 0, 0]
    assert inputs.slots[:9].tolist() == [6 * BS + 2, 7 * BS + 3, 8 * BS + 0, 8 * BS + 1, 8 * BS + 2, 8 * BS + 3,
                                         3 * BS + 0, -1, -1]
    assert inputs.query_start_loc.tolist() == [0, 1, 6, 7, 7, 7]
    assert inputs.seq_lens.tolist() == [7, 8, 5, 1, 1]
    assert inputs.decode_rows.tolist() == [0, 6, 8, 8] and inputs.decode_seqs.tolist() == [0, 2, 4, 4]
    tiles = inputs.tiles_for(8)
    assert tiles == 8
    assert list(zip(inputs.tile_seq[:3].tolist(), inputs.tile_m0[:3].tolist())) == [(1, 4), (1, 2), (1, 0)]
    assert set(inputs.tile_seq[3:].tolist()) == {4}
    assert inputs.logits_rows.tolist() == [0, 5, 6, 8]
    if compact:     # the scheduled sequences' tables travel at their width (2); the graph's first launch spreads them
        assert inputs.shape.tolist() == [3, 2] and inputs.packed[:6].tolist() == [5, 6, 7, 8, 9, 3]
        inputs.unpack()
    assert inputs.block_tables[:3, :2].tolist() == [[5, 6], [7, 8], [9, 3]] and inputs.block_tables[4].sum() == 0
    batch = inputs.batch(8, BS, 64)
    assert batch.input_ids.shape == (9,) and batch.logits_indices.shape == (4,) and not batch.is_decode_only


def _prompts():
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 500, (19,), generator=g).tolist()
    return [torch.randint(0, 500, (n,), generator=g).tolist() for n in (13, 40)] + \
        [shared + torch.randint(0, 500, (n,), generator=g).tolist() for n in (3, 11, 29)]


def test_engine_steps_with_prompt_work_replay_mixed_graphs(tiny_llama):
    """Chunked prompts beside decodes (16-token steps), prefix-cache hits, overlapped scheduling (in-flight decode
    tokens patched into the static inputs): greedy tokens equal a plain engine's, steps with prompt work replayed
    the mixed graphs (with decode rows beside prompt rows), and no block is left allocated."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    kw = dict(skip_tokenizer_init=True, dtype="float32", block_size=8, max_num_batched_tokens=16,
              enable_chunked_prefill=True)
    want = [o.outputs[0].token_ids for o in LLM(tiny_llama, **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(tiny_llama, async_scheduling=True, **kw)
    install_twin_triton_attention(llm)
    graphs = install_eager_replay_graphs(llm, [llm.engine.config.scheduler.max_model_len], sizes=(1, 2, 4, 8),
                                         mixed_buckets=(8, 16))
    replayed = []
    run_mixed = graphs.run_mixed

    def recording(out, tokens, patch=None):
        replayed.append((tokens, [s.num_new_tokens for s in out.scheduled]))
        return run_mixed(out, tokens, patch)
    graphs.run_mixed = recording
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert len(replayed) >= 5 and all(sum(rows) <= t for t, rows in replayed)
    assert any(sum(rows) < t for t, rows in replayed)                     # padding rows
    assert any(1 in rows and max(rows) > 1 for _, rows in replayed)       # decodes beside a prompt chunk
    assert llm.engine.block_manager.prefix_hits > 0 and graphs.num_replays > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_large_decode_batches_read_int32_copies_of_their_inputs(tiny_llama):
    """From INT32_DECODE_INPUTS_MIN_ROWS decode rows, the captured forward first converts the step's block tables and
    lengths (and a mixed graph's row indices) to int32 (`begin_forward`), and the decode attention reads those: 20
    sequences through decode graphs of 32 rows and mixed graphs, greedy tokens equal a plain engine's. The copies
    are made inside every replay, so a step never reads the tables of the step the graph was captured with."""
    from deepserve.layers.attention_triton import INT32_DECODE_INPUTS_MIN_ROWS
    g = torch.Generator().manual_seed(9)
    prompts = [{"prompt_token_ids": torch.randint(0, 500, (n,), generator=g).tolist()}
               for n in torch.randint(3, 30, (20,), generator=g).tolist()]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    kw = dict(skip_tokenizer_init=True, dtype="float32", block_size=8, max_num_batched_tokens=64,
              enable_chunked_prefill=True, max_num_seqs=32)
    want = [o.outputs[0].token_ids for o in LLM(tiny_llama, **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(tiny_llama, **kw)
    install_twin_triton_attention(llm)
    graphs = install_eager_replay_graphs(llm, [llm.engine.config.scheduler.max_model_len], sizes=(1, 8, 16, 32),
                                         mixed_buckets=(64,))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert graphs.num_replays > 0 and graphs.num_mixed_replays > 0
    big = graphs.batches[32, graphs.buckets[0]].attn_metadata
    assert big.num_decodes >= INT32_DECODE_INPUTS_MIN_ROWS
    assert big.decode_tables.dtype == big.decode_lens.dtype == big.decode_rows.dtype == torch.int32
    mixed = graphs.mixed_batches[64].attn_metadata
    assert mixed.decode_rows.dtype == torch.int64 and mixed.decode_rows_i32.dtype == torch.int32
    small = graphs.batches[8, graphs.buckets[0]].attn_metadata
    assert small.decode_tables is None           # below the threshold: the int64 inputs, no conversion launches
