"""compress_step (layers/compressor.py) in a decode-only step, the form a CUDA graph captures: one possible entry
per row, and every write that must land nowhere (a padding row's, an entry the row does not complete) goes to the
scratch slot -1, the last slot of the scratch block past the sequences' blocks."""

from __future__ import annotations

import torch

from deepserve.layers.compressor import GatedPoolCompressor, compress_step
from deepserve.layers.paged_state import PagedState, RowSlots

BS = 4          # block size (token positions per block)


def _state(width: int, ratio: int, num_blocks: int) -> PagedState:
    state = PagedState("s", width, ratio, torch.float32)
    state.kv_cache = torch.zeros(state.kv_cache_shape(num_blocks + 1, BS))        # + the scratch block
    return state


def _run(ratio: int, positions: list[int], slots: list[int], tables: list[list[int]]):
    torch.manual_seed(0)
    comp = GatedPoolCompressor(hidden=8, head_dim=6, ratio=ratio, eps=1e-6)
    token_state = _state(comp.state_width, 0, num_blocks=4)
    rows = RowSlots(torch.tensor(tables), torch.arange(len(positions)), BS, torch.tensor(tables))
    x = torch.randn(len(positions), 8)
    new = compress_step(comp, x, torch.tensor(slots), torch.tensor(positions), rows, token_state, decode_only=True)
    return comp, x, token_state, new


def test_padding_rows_and_incomplete_entries_write_only_the_scratch_slot():
    # Row 0: position 5 of a sequence in blocks [2, 1] (ratio 2: completes entry 2, the pair 4, 5).
    # Row 1: position 6 of a sequence in blocks [3, 0] (completes nothing). Row 2: padding (slot -1, table of 0s).
    comp, x, token_state, new = _run(2, [5, 6, 0], [1 * BS + 1, 0 * BS + 2, -1], [[2, 1], [3, 0], [0, 0]])
    per_block = BS // 2
    assert new.slots.tolist() == [1 * per_block + 0, -1, -1]       # entry 2 sits in the block of token 5: block 1
    assert new.index.tolist() == [2, 2, 0]                          # (p + 1) // ratio - 1, clamped at 0
    flat = token_state.flat()
    written = (flat != 0).any(-1).nonzero().flatten().tolist()
    scratch = flat.shape[0] - 1
    assert written == [0 * BS + 2, 1 * BS + 1, scratch]             # the two rows' tokens; the padding row's scratch
    # Row 0's entry pools tokens 4 (not in this step: zero state here, masked in by position) and 5.
    assert torch.equal(new.pre_rope[0], comp.pool(flat[[1 * BS + 0, 1 * BS + 1]][None], torch.tensor([[True, True]]),
                                                  torch.tensor([2]))[0])


def test_ratio_one_completes_an_entry_at_every_real_row_but_not_at_padding():
    comp, x, token_state, new = _run(1, [3, 0], [2 * BS + 3, -1], [[2], [0]])
    assert new.slots.tolist() == [2 * BS + 3, -1]                   # padding would have written block 0's entry 0
    assert torch.allclose(new.pre_rope[0], comp.norm(comp.wkv(x[:1]))[0])
