"""The kernels that finish a decode graph's inputs (kernels/graph_inputs.py) against their PyTorch twins: the
in-flight token patch and the block tables' unpacking."""

import pytest
import torch

from deepserve.kernels.graph_inputs import (UNPACK_BLOCK, patch_tokens, patch_tokens_ref, unpack_tables,
                                            unpack_tables_ref)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows", [1, 8, 37, 256])
def test_patch_matches_reference(device, rows):
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(0, 1000, (rows,), generator=g).to(device)
    tokens = torch.randint(1000, 2000, (300,), generator=g).to(device)
    src = torch.randint(-1, 300, (rows,), generator=g).to(device)
    src[0] = -1
    want = ids.clone()
    patch_tokens_ref(want, src, tokens)
    patch_tokens(ids, src, tokens)
    assert torch.equal(ids, want) and ids[0] < 1000
    assert ((ids >= 1000) == (src >= 0)).all()


@pytest.mark.parametrize("rows,used,width", [(1, 1, 1), (8, 8, 70), (9, 3, 70), (33, 30, 2 * UNPACK_BLOCK + 5)])
def test_unpack_matches_reference(device, rows, used, width):
    """The first `used` of `rows` rows get `width` packed entries each, spread over [rows, max_blocks] tables;
    entries past the width, and the rows past `used`, untouched."""
    max_blocks = width + 40
    g = torch.Generator().manual_seed(width + used)
    packed = torch.randint(0, 10_000, (rows * width + 17,), generator=g).to(device)
    stale = torch.full((rows, max_blocks), -3, dtype=torch.int64, device=device)
    got, want = stale.clone(), stale.clone()
    shape = torch.tensor([used, width], device=device)
    unpack_tables(packed, shape, got)
    unpack_tables_ref(packed, shape, want)
    assert torch.equal(got, want)
    assert torch.equal(got[:used, :width].reshape(-1), packed[:used * width])
    assert (got[:, width:] == -3).all() and (got[used:] == -3).all()
