"""The kernels that finish a decode graph's inputs (kernels/graph_inputs.py) against their PyTorch twins: the
in-flight token patch, the block tables' unpacking, and both from a pinned host buffer in one launch."""

import pytest
import torch

from deepserve.kernels.graph_inputs import (UNPACK_BLOCK, load_inputs, load_inputs_ref, patch_tokens,
                                            patch_tokens_ref, unpack_tables, unpack_tables_ref)

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


@pytest.mark.parametrize("size,width,tables_a_row", [(1, 66, 1), (8, 3, 1), (37, 300, 1), (5, 9, 2)])
def test_load_from_the_host_buffer_matches_reference(device, size, width, tables_a_row):
    """A step's inputs read from a pinned host buffer (DEEPSERVE_MAPPED_STEP_IO): the columns of rows < size, the
    tables' shape, the packed tables spread to max_blocks entries a row (loops past the kernel's 256-entry block),
    the carried rows' ids from the token buffer; rows past `size` and entries past the width untouched."""
    columns, mb, max_blocks = 6, 64, 320
    start = columns * mb + 2
    g = torch.Generator().manual_seed(size * width)
    host = torch.randint(0, 10_000, (start + mb * tables_a_row * max_blocks,), generator=g)
    host[start - 2:start] = torch.tensor([size * tables_a_row, width])
    src = torch.randint(-1, 50, (size,), generator=g)
    src[0] = -1
    host[(columns - 1) * mb:(columns - 1) * mb + size] = src
    if torch.device(device).type == "cuda":
        host = host.pin_memory()
    tokens = torch.randint(20_000, 30_000, (mb,), generator=g).to(device)
    stale_dev = torch.full((start,), -7, dtype=torch.int64, device=device)
    stale_tables = torch.full((mb, tables_a_row, max_blocks), -3, dtype=torch.int64, device=device)
    got, got_tables = stale_dev.clone(), stale_tables.clone()
    want, want_tables = stale_dev.clone(), stale_tables.clone()
    args = (size, mb, columns, start, 0, columns - 1)
    load_inputs(host, got, got_tables, tokens, *args)
    load_inputs_ref(host.to(device), want, want_tables, tokens, *args)
    assert torch.equal(got, want) and torch.equal(got_tables, want_tables)
    ids = got[:size].cpu()
    assert torch.equal(ids >= 20_000, src >= 0) and ids[0] == host[0]
    for c in range(1, columns):
        assert torch.equal(got[c * mb:c * mb + size].cpu(), host[c * mb:c * mb + size])
        assert (got[c * mb + size:(c + 1) * mb] == -7).all()
    packed = host[start:start + size * tables_a_row * width].view(size, tables_a_row, width)
    assert torch.equal(got_tables[:size, :, :width].cpu(), packed)
    assert (got_tables[:, :, width:] == -3).all() and (got_tables[size:] == -3).all()
