"""ForwardBatch's one-copy upload: every index tensor starts on a 16-byte boundary (Triton compiles a kernel
variant per pointer alignment; views at arbitrary offsets would compile new variants while serving)."""

import numpy as np
import torch

from deepserve.layers.forward_batch import upload_int64


def test_upload_views_are_16_byte_aligned_and_exact():
    parts = [np.arange(3), [], np.arange(10, 15), [7], np.arange(4)]
    views = upload_int64(parts, torch.device("cpu"))
    assert [v.tolist() for v in views] == [list(np.asarray(p, dtype=np.int64)) for p in parts]
    assert all(v.data_ptr() % 16 == 0 for v in views if v.numel())
    assert all(v.dtype == torch.int64 for v in views)


def _sequence(seq_id: int, num_tokens: int, computed: int):
    from deepserve.sampling_params import SamplingParams
    from deepserve.sequence import Sequence
    seq = Sequence(seq_id, str(seq_id), 0, list(range(10, 10 + num_tokens)), SamplingParams(), seed=0)
    seq.block_table = [seq_id, seq_id + 4, seq_id + 8]
    seq.num_computed_tokens = computed
    return seq


def test_logits_rows_skip_the_gather_only_where_every_row_samples():
    """A decode step (each row samples, in order) marks its batch `logits_every_row`: the model's final hidden
    states are taken as they are. A step with a prompt chunk (its last row samples) or rows asked out of order
    gathers them."""
    from deepserve.worker.batch_builder import build_forward_batch
    from deepserve.worker.scheduler_output import ScheduledSequence, SchedulerOutput
    decodes = [_sequence(1, 6, 5), _sequence(2, 9, 8)]
    out = SchedulerOutput(scheduled=[ScheduledSequence(s, s.num_tokens - 1, 1) for s in decodes])
    batch = build_forward_batch(out, 4, torch.device("cpu"), [[0], [0]])
    x = torch.randn(2, 3)
    assert batch.logits_every_row and batch.logits_rows(x) is x
    mixed = SchedulerOutput(scheduled=[ScheduledSequence(_sequence(3, 5, 0), 0, 5),
                                       ScheduledSequence(decodes[0], 5, 1)])
    batch = build_forward_batch(mixed, 4, torch.device("cpu"), [[4], [0]])
    x = torch.randn(6, 3)
    assert not batch.logits_every_row and torch.equal(batch.logits_rows(x), x[[4, 5]])
    batch = build_forward_batch(mixed, 4, torch.device("cpu"), [[0, 1, 2, 3, 4], [0]])
    assert batch.logits_every_row          # prompt logprobs of every row, and the decode's
