"""CUDA-graph bookkeeping that needs no GPU: capture sizes, padding, the static input layout, and what a replay hands
back (logits, and the hidden states kept for an eager drafter)."""

import pytest
import torch

from deepserve.worker.scheduler_output import ScheduledSequence, SchedulerOutput
from deepserve.sequence import Sequence
from deepserve.sampling_params import SamplingParams
from deepserve.worker.cuda_graph import (COMPACT_MIN_BLOCKS, CUDAGraphRunner, StaticDecodeInputs, compact_tables_for,
                                         default_capture_sizes, padded_size)


def test_capture_sizes_cover_every_batch_up_to_the_limit():
    sizes = default_capture_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256
    assert all(b - a <= 16 for a, b in zip(sizes, sizes[1:]))
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_capture_sizes(1000, limit=64)[-1] == 64
    for batch in range(1, 257):
        size = padded_size(batch, sizes)
        assert size >= batch and size - batch < 16
    assert padded_size(257, sizes) is None


def _decoding_sequence(seq_id: int, num_tokens: int, blocks: list[int]) -> Sequence:
    seq = Sequence(seq_id, str(seq_id), 0, list(range(10, 10 + num_tokens)), SamplingParams(), seed=0)
    seq.block_table = blocks
    seq.num_computed_tokens = num_tokens - 1
    return seq


def test_static_inputs_hold_the_batch_then_padding():
    bs = 4
    inputs = StaticDecodeInputs(max_batch=8, max_blocks=4, device=torch.device("cpu"))
    seqs = [_decoding_sequence(1, 6, [7, 3]), _decoding_sequence(2, 9, [5, 1, 2])]
    out = SchedulerOutput(scheduled=[ScheduledSequence(s, s.num_tokens - 1, 1) for s in seqs])
    inputs.fill(out, size=4, block_size=bs)
    batch = inputs.batch(4, bs, 16)
    assert batch.input_ids.tolist() == [15, 18, 0, 0]
    assert batch.positions.tolist() == [5, 8, 0, 0]
    # position 5 -> block index 1 (block 3), offset 1; position 8 -> block index 2 (block 2), offset 0
    assert batch.slot_mapping.tolist() == [3 * bs + 1, 2 * bs + 0, -1, -1]
    assert batch.seq_lens.tolist() == [6, 9, 1, 1]
    assert batch.block_tables[:2, :3].tolist() == [[7, 3, 0], [5, 1, 2]]
    assert batch.block_tables[2:].abs().sum().item() == 0
    assert batch.logits_indices.tolist() == [0, 1, 2, 3]
    assert batch.logits_every_row     # every row samples: the model takes its hidden states without a gather
    # A smaller batch next step overwrites the old rows with padding.
    inputs.fill(SchedulerOutput(scheduled=out.scheduled[:1]), size=2, block_size=bs)
    assert inputs.batch(2, bs, 16).slot_mapping.tolist() == [3 * bs + 1, -1]


@pytest.mark.parametrize("window", [False, True])
def test_compact_tables_travel_at_the_step_width_and_unpack_to_the_full_tables(window):
    """compact: the host copy holds each row's tables at the step's longest table's width (then padding rows), the
    width rides along, and `unpack` (a graph's first launch) spreads them into the tables the kernels read, equal
    to the full-width layout's where a row has blocks. A later, narrower step leaves wider entries behind, which
    no kernel reads (they lie past every row's own blocks)."""
    bs, max_blocks = 4, 16
    seqs = [_decoding_sequence(1, 6, [7, 3]), _decoding_sequence(2, 9, [5, 1, 2])]
    if window:
        seqs[0].window_table, seqs[1].window_table = [-1, 4], [6, -1, 8]
    out = SchedulerOutput(scheduled=[ScheduledSequence(s, s.num_tokens - 1, 1) for s in seqs])
    full = StaticDecodeInputs(max_batch=8, max_blocks=max_blocks, device=torch.device("cpu"), window=window)
    compact = StaticDecodeInputs(max_batch=8, max_blocks=max_blocks, device=torch.device("cpu"), window=window,
                                 compact=True)
    for inputs in (full, compact):
        inputs.fill(out, size=4, block_size=bs)
    per_row = 2 if window else 1
    assert compact.shape.tolist() == [4 * per_row, 3]
    assert compact.packed[:4 * per_row * 3].view(4, per_row, 3)[:, 0].tolist() == \
        [[7, 3, 0], [5, 1, 2], [0, 0, 0], [0, 0, 0]]
    compact.unpack(4)
    assert torch.equal(compact.tables[:4, :, :3], full.tables[:4, :, :3])
    assert compact.batch(4, bs, 64).block_tables[:2, :3].tolist() == [[7, 3, 0], [5, 1, 2]]
    if window:
        assert compact.batch(4, bs, 64).window_block_tables[:2, :3].tolist() == [[0, 4, 0], [6, 0, 8]]
    for name in ("input_ids", "positions", "slots", "seq_lens", "window_slots", "token_src"):
        assert torch.equal(getattr(compact, name)[:4], getattr(full, name)[:4]), name
    compact.fill(SchedulerOutput(scheduled=out.scheduled[:1]), size=2, block_size=bs)
    compact.unpack(2)
    assert compact.shape.tolist() == [2 * per_row, 2] and compact.tables[:2, 0, :3].tolist() == [[7, 3, 0], [0, 0, 2]]


def test_a_decode_with_drafts_fills_one_decode_row_per_position():
    """Speculative decoding in a graph: the known token then each draft, at consecutive positions, each row seeing
    the keys up to its own position (the rows before it included)."""
    bs = 4
    inputs = StaticDecodeInputs(max_batch=8, max_blocks=4, device=torch.device("cpu"))
    plain, drafting = _decoding_sequence(1, 6, [7, 3]), _decoding_sequence(2, 7, [5, 1, 2])
    out = SchedulerOutput(scheduled=[ScheduledSequence(plain, 5, 1),
                                     ScheduledSequence(drafting, 6, 3, draft_token_ids=[40, 41])])
    inputs.fill(out, size=4, block_size=bs)
    batch = inputs.batch(4, bs, 16)
    assert batch.input_ids.tolist() == [15, 16, 40, 41]
    assert batch.positions.tolist() == [5, 6, 7, 8]
    assert batch.slot_mapping.tolist() == [3 * bs + 1, 1 * bs + 2, 1 * bs + 3, 2 * bs + 0]
    assert batch.seq_lens.tolist() == [6, 7, 8, 9]
    assert batch.block_tables[1:4, :3].tolist() == [[5, 1, 2]] * 3


class _ToyModel(torch.nn.Module):
    """What the graph runner captures, without attention: hidden = embed(id) + position, logits = head(hidden)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)

    def forward(self, batch):
        return self.embed(batch.input_ids) + batch.positions[:, None].float()

    def compute_logits(self, hidden):
        return self.head(hidden).float()


class _EagerGraph:
    """A captured graph's stand-in on the CPU: replay runs the captured work."""

    def __init__(self, work) -> None:
        self.work = work

    def replay(self) -> None:
        self.work()


@pytest.mark.parametrize("keep_hidden", [False, True])
def test_a_replay_hands_back_logits_and_the_kept_hidden_states(keep_hidden):
    """The captured work copies logits (and with keep_hidden every row's model output) into the static buffers; run
    returns the step's rows of them, in scheduled order, and the static batch the graph read."""
    bs = 4
    model = _ToyModel()
    graphs = CUDAGraphRunner(model, None, bs, max_model_len=16, vocab_size=10, capture_sizes=[2, 4],
                             device=torch.device("cpu"), keep_hidden=keep_hidden)
    for size in reversed(graphs.sizes):
        key = (size, 16)                                    # one context bucket: max_model_len
        batch = graphs.batches[key] = graphs.inputs.batch(size, bs, 16)
        graphs.graphs[key] = _EagerGraph(lambda batch=batch, size=size: graphs._forward(batch, size))
    plain, drafting = _decoding_sequence(1, 6, [7, 3]), _decoding_sequence(2, 7, [5, 1, 2])
    out = SchedulerOutput(scheduled=[ScheduledSequence(plain, 5, 1),
                                     ScheduledSequence(drafting, 6, 3, draft_token_ids=[40, 41])])
    replay = graphs.run(out, graphs.size_for(out))
    want = model.embed(torch.tensor([15, 16, 40, 41])) + torch.tensor([5.0, 6.0, 7.0, 8.0])[:, None]
    assert torch.allclose(replay.logits, model.compute_logits(want))
    if keep_hidden:
        assert graphs.hidden.shape == (4, 4) and torch.equal(replay.hidden, want)
    else:
        assert replay.hidden is None and graphs.hidden is None
    assert replay.batch is graphs.batches[4, 16] and graphs.num_replays == 1
    # A one-row step replays the size-2 graph: its first row only.
    replay = graphs.run(SchedulerOutput(scheduled=out.scheduled[:1]), (2, 16))
    assert replay.logits.shape[0] == 1
    if keep_hidden:
        assert torch.equal(replay.hidden, want[:1])


class _HalfHeadModel(_ToyModel):
    """A bf16 model: `head_logits` is the LM head's own output, `compute_logits` its float32 copy."""

    def __init__(self) -> None:
        super().__init__()
        self.to(torch.bfloat16)

    def forward(self, batch):
        return self.embed(batch.input_ids) + batch.positions[:, None].to(torch.bfloat16)

    def head_logits(self, hidden):
        return self.head(hidden)

    def compute_logits(self, hidden):
        return self.head_logits(hidden).float()


def test_a_replay_keeps_the_heads_own_dtype():
    """The static logits buffer takes the dtype of `head_logits` (bf16 here, half the bytes of a float32 copy), and
    the replay's rows are the head's output bit for bit, so an argmax of them is the argmax of the float32 logits."""
    bs = 4
    model = _HalfHeadModel()
    graphs = CUDAGraphRunner(model, None, bs, max_model_len=16, vocab_size=10, capture_sizes=[2, 4],
                             device=torch.device("cpu"))
    assert graphs.logits is None                        # allocated by the first (largest) capture's warm-up
    for size in reversed(graphs.sizes):
        key = (size, 16)
        batch = graphs.batches[key] = graphs.inputs.batch(size, bs, 16)
        graphs.graphs[key] = _EagerGraph(lambda batch=batch, size=size: graphs._forward(batch, size))
    seqs = [_decoding_sequence(1, 6, [7, 3]), _decoding_sequence(2, 9, [5, 1, 2]), _decoding_sequence(3, 4, [6])]
    out = SchedulerOutput(scheduled=[ScheduledSequence(s, s.num_tokens - 1, 1) for s in seqs])
    replay = graphs.run(out, graphs.size_for(out))
    assert graphs.logits.dtype == torch.bfloat16 and graphs.logits.shape == (4, 10)
    hidden = model.embed(torch.tensor([15, 18, 13])) + torch.tensor([5, 8, 3], dtype=torch.bfloat16)[:, None]
    assert replay.logits.dtype == torch.bfloat16
    assert torch.equal(replay.logits, model.head_logits(hidden))
    assert torch.equal(replay.logits.argmax(-1), model.compute_logits(hidden).argmax(-1))


def test_compact_tables_auto_packs_long_rows_only():
    """DEEPSERVE_COMPACT_BLOCK_TABLES=auto: packed where max_model_len's table row holds COMPACT_MIN_BLOCKS blocks
    (an engine sized for a 128k context), at full width where it is short (the decode sweep's ~1.1k); 1 / 0 force."""
    assert COMPACT_MIN_BLOCKS == 512
    assert compact_tables_for("auto", 131072, 16) and compact_tables_for("auto", 8192, 16)
    assert not compact_tables_for("auto", 8176, 16) and not compact_tables_for("auto", 1100, 16)    # 511, 69 blocks
    assert not compact_tables_for("auto", 8192, 32)           # 256 blocks of 32 tokens
    assert compact_tables_for("1", 1100, 16) and not compact_tables_for("0", 131072, 16)


def test_compact_tables_setting_rejects_other_values(monkeypatch):
    from deepserve import envs
    monkeypatch.setenv("DEEPSERVE_COMPACT_BLOCK_TABLES", "sometimes")
    with pytest.raises(ValueError, match="auto, 1, 0"):
        envs.DEEPSERVE_COMPACT_BLOCK_TABLES
