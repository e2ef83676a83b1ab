"""The packed-key top-k (deepserve/kernels/topk.py) against the reference's stable sort, bit for bit: random
scores, many exact ties (coarsely quantized scores), -0.0 against +0.0, rows with fewer allowed entries than k,
k above the row length, empty inputs."""

import pytest
import torch

from deepserve.kernels import topk
from deepserve.kernels.reference import sparse_attention as reference


def cases():
    gen = torch.Generator().manual_seed(0)
    yield "random", torch.randn(7, 300, generator=gen), torch.rand(7, 300, generator=gen) > 0.2
    # Scores on a grid of 5 values: most of a row ties with others, the k-th value straddles the cut.
    tied = torch.randint(-2, 3, (9, 257), generator=gen).float() * 0.5
    yield "ties", tied, torch.rand(9, 257, generator=gen) > 0.1
    zeros = torch.zeros(3, 64)
    zeros[:, ::2] = -0.0
    zeros[:, 5] = 1.0
    yield "signed zeros", zeros, torch.ones(3, 64, dtype=torch.bool)
    few = torch.randn(4, 50, generator=gen)
    allowed = torch.zeros(4, 50, dtype=torch.bool)
    allowed[0, :3] = True
    allowed[1, 10:40] = True
    allowed[3, :] = True                    # row 2: nothing allowed
    yield "few allowed", few, allowed
    big = torch.randn(2, 5, generator=gen) * 1e30
    yield "huge magnitudes", big, torch.ones(2, 5, dtype=torch.bool)


@pytest.mark.parametrize("k", [1, 4, 16, 64, 400])
def test_topk_indices_equals_the_stable_sort(k):
    for name, scores, allowed in cases():
        expect = reference.topk_indices(scores, allowed, k)
        got = topk.topk_indices(scores, allowed, k)
        assert torch.equal(got, expect), (name, k)


@pytest.mark.parametrize("k", [1, 4, 16, 64, 400])
def test_topk_mask_equals_the_stable_sort(k):
    for name, scores, allowed in cases():
        assert torch.equal(topk.topk_mask(scores, allowed, k), reference.topk_mask(scores, allowed, k)), (name, k)


def test_ties_go_to_the_lower_index():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    allowed = torch.ones_like(scores, dtype=torch.bool)
    assert topk.topk_indices(scores, allowed, 3).tolist() == [[1, 2, 4]]
    assert topk.topk_indices(scores, allowed, 2).tolist() == [[1, 2]]


def test_empty_inputs():
    none = torch.zeros(0, 10)
    assert topk.topk_indices(none, none.bool(), 4).shape == (0, 4)
    width0 = torch.zeros(3, 0)
    assert torch.equal(topk.topk_indices(width0, width0.bool(), 4), torch.full((3, 4), -1))
    assert topk.topk_mask(width0, width0.bool(), 4).shape == (3, 0)
