"""The in-flight token patch of overlapped scheduling (worker/launched_step.patch_inflight_tokens): each row whose
input token the previous step is still sampling reads it from that step's device tokens, through the one-copy path
when the rows are the previous step's rows in order and through the index path otherwise."""

from __future__ import annotations

import pytest
import torch

from deepserve.worker.launched_step import LaunchedStep, patch_inflight_tokens


def _previous(seq_ids: list[int], tokens: list[int]) -> LaunchedStep:
    return LaunchedStep(row_of={s: i for i, s in enumerate(seq_ids)}, device_tokens=torch.tensor(tokens))


@pytest.mark.parametrize("rows, want", [
    ([(0, 10), (1, 11), (2, 12)], [100, 101, 102, 7]),          # steady decode: rows 0..2 in the previous order
    ([(0, 10), (1, 11)], [100, 101, 0, 7]),                      # a prefix of them (the last sequence finished)
    ([(0, 12), (1, 10), (2, 11)], [102, 100, 101, 7]),           # reordered
    ([(1, 10), (2, 11)], [0, 100, 101, 7]),                      # shifted (a row before them is a prompt's)
    ([(3, 12)], [0, 0, 0, 102]),                                 # one row elsewhere
])
def test_rows_read_their_sequences_tokens(rows, want):
    input_ids = torch.tensor([0, 0, 0, 7])
    patch_inflight_tokens(input_ids, rows, _previous([10, 11, 12], [100, 101, 102]))
    assert input_ids.tolist() == want


def test_nothing_in_flight_is_a_no_op_and_a_missing_step_an_error():
    input_ids = torch.tensor([5, 6])
    patch_inflight_tokens(input_ids, [], None)
    assert input_ids.tolist() == [5, 6]
    with pytest.raises(RuntimeError, match="no launched step"):
        patch_inflight_tokens(input_ids, [(0, 10)], None)
