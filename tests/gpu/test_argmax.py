"""Row-wise argmax kernel (the greedy sampler's pick on the GPU) against torch.argmax."""

import pytest
import torch

from deepserve.kernels.argmax import argmax_rows, argmax_rows_ref

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("rows,vocab", [(1, 128256), (3, 4096), (5, 4097), (2, 100), (64, 151936), (0, 10)])
def test_argmax_matches_torch(device, rows, vocab):
    x = torch.randn(rows, vocab, device=device)
    assert torch.equal(argmax_rows(x), argmax_rows_ref(x))


def test_ties_take_the_lowest_index(device):
    x = torch.zeros(4, 9000, device=device)
    x[0, [5, 4500, 8999]] = 3.0          # the same maximum in three pieces
    x[1, [8999, 4096]] = 1.0             # in two pieces, the lower one second in memory order of the pieces
    x[2] = float("-inf")                 # an all -inf row (every token banned): index 0, like torch
    x[3, 4095:4097] = 2.0                # across a piece boundary
    assert argmax_rows(x).tolist() == argmax_rows_ref(x).tolist() == [5, 4096, 0, 4095]


def test_strided_rows(device):
    x = torch.randn(6, 2 * 5000, device=device)[:, :5000]   # rows not contiguous with each other
    assert torch.equal(argmax_rows(x), argmax_rows_ref(x))


def test_into_a_given_buffer(device):
    """`out`: a CUDA graph's static token buffer (a prefix of it) receives the argmax, and is what comes back."""
    x = torch.randn(5, 30000, device=device)
    buffer = torch.full((8,), -7, dtype=torch.int64, device=device)
    got = argmax_rows(x, out=buffer[:5])
    assert got.data_ptr() == buffer.data_ptr() and torch.equal(buffer[:5], argmax_rows_ref(x))
    assert buffer[5:].tolist() == [-7] * 3


def test_into_pinned_host_memory_too(device):
    """`host_out` (DEEPSERVE_MAPPED_STEP_IO): the kernel also writes the tokens into pinned host memory, which the
    host reads after a synchronisation, with no copy launched; inside a CUDA graph too."""
    if torch.device(device).type != "cuda":
        pytest.skip("pinned host memory written by a kernel needs a GPU")
    x = torch.randn(5, 30000, device=device)
    out = torch.empty(5, dtype=torch.int64, device=device)
    host = torch.full((5,), -7, dtype=torch.int64, pin_memory=True)
    argmax_rows(x, out=out, host_out=host)
    torch.cuda.synchronize()
    assert torch.equal(host, argmax_rows_ref(x).cpu()) and torch.equal(out.cpu(), host)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        argmax_rows(x, out=out, host_out=host)
    x.copy_(torch.randn(5, 30000, device=device))
    host.fill_(-7)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(host, argmax_rows_ref(x).cpu())
