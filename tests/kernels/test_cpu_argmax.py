"""The C row-wise argmax (the greedy pick on the CPU) against torch.argmax: ties, -inf rows, NaN, strides."""

import pytest
import torch

from deepserve.kernels.cpu import argmax

needs_kernels = pytest.mark.skipif(argmax._library() is None, reason="no C compiler or DEEPSERVE_CPU_KERNELS=0")


@needs_kernels
@pytest.mark.parametrize("rows,cols", [(1, 49152), (64, 49152), (3, 1), (5, 17)])
def test_matches_torch(rows, cols):
    x = torch.randn(rows, cols)
    assert torch.equal(argmax.argmax_rows(x), x.argmax(dim=-1))


@needs_kernels
def test_ties_inf_nan_and_strides():
    x = torch.zeros(5, 40)
    x[0, [3, 9]] = 2.0                     # a tie: the first
    x[1] = float("-inf")                   # every token banned: 0
    x[2, [5, 30]] = float("nan")           # NaN counts as the maximum: the first NaN
    x[3, 39] = float("inf")
    x[4, [0, 39]] = -1.0                   # the maximum (0) at index 1
    assert argmax.argmax_rows(x).tolist() == x.argmax(dim=-1).tolist() == [3, 0, 5, 39, 1]
    y = torch.randn(4, 100)[:, ::2].contiguous()[:, :30]
    z = torch.randn(6, 64)[:, :50]           # rows not contiguous with each other
    assert torch.equal(argmax.argmax_rows(z), z.argmax(dim=-1))
    assert torch.equal(argmax.argmax_rows(y), y.argmax(dim=-1))


def test_other_dtypes_fall_back():
    assert argmax.argmax_rows(torch.randn(2, 8, dtype=torch.float64)) is None
    assert argmax.argmax_rows(torch.randn(8)) is None
