"""spec_decode/drafts.py's ScheduledRows names what a model drafter reads of the worker's ScheduledSequence, so
that spec_decode needs no import of the worker's floor: the two must keep agreeing."""

import dataclasses
import typing

from deepserve.sampling_params import SamplingParams
from deepserve.sequence import Sequence
from deepserve.spec_decode.drafts import ScheduledRows
from deepserve.worker.scheduler_output import ScheduledSequence


def test_scheduled_sequence_has_every_field_a_drafter_reads_with_its_type():
    wanted = typing.get_type_hints(ScheduledRows)
    fields = {f.name: f for f in dataclasses.fields(ScheduledSequence)}
    have = typing.get_type_hints(ScheduledSequence)
    assert set(wanted) <= set(fields), set(wanted) - set(fields)
    for name, kind in wanted.items():
        assert have[name] == kind, (name, have[name], kind)


def test_a_scheduled_sequence_reads_as_the_rows_a_drafter_sees():
    seq = Sequence(0, "r0", 0, [5, 6, 7], SamplingParams(max_tokens=4), seed=0)
    rows: ScheduledRows = ScheduledSequence(seq, start=0, num_new_tokens=3)
    assert (rows.seq, rows.start, rows.num_new_tokens, rows.samples) == (seq, 0, 3, True)
    assert ScheduledSequence(seq, start=0, num_new_tokens=2).samples is False
