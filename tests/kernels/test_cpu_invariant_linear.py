"""The batch-invariant linear layer: each output row is bitwise a function of its own input row (whatever the row
count, the row's place, the thread count), and close to the exact product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepserve.kernels.cpu import invariant_linear as c_linear
from deepserve.layers.linear import INVARIANT_ROW_TILE, invariant_linear

needs_kernel = pytest.mark.skipif(c_linear._library() is None, reason="the CPU C kernels are not buildable here")

# (K, N): the tiny test models' shapes and the default model's (SmolLM2-135M: hidden 576, MLP 1536, vocab 49152).
# (64, 13) and (128, 64): one weight row left over after blocks of 3 and of 4 (AVX2's and AVX-512's column blocks).
SHAPES = [(64, 128), (64, 36), (576, 960), (1536, 576), (576, 5003), (64, 13), (128, 64)]
ROW_COUNTS = [1, 2, 3, 4, 5, 7, 16, 33, 64, 65, 130]


@pytest.fixture(params=[8, 16], ids=["lanes8", "lanes16"])
def lanes(request, monkeypatch):
    """The kernel built with 8-float vectors (CPUs without AVX-512) and with 16-float ones (AVX-512's), whatever this
    CPU's own width: both keep the invariant anywhere, so both are tested on every CPU."""
    monkeypatch.setattr(c_linear, "_DEFINES", (f"LINEAR_LANES={request.param}",))
    c_linear._load.cache_clear()
    yield request.param
    c_linear._load.cache_clear()


def rows_alone_and_batched(fn, k: int, n: int, seed: int = 0):
    """(row 0 computed alone, row 0 computed at a random place among M - 1 random rows) for every M."""
    gen = torch.Generator().manual_seed(seed)
    weight, bias = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    x = torch.randn(1, k, generator=gen)
    alone = fn(x, weight, bias)[0]
    batched = []
    for m in ROW_COUNTS:
        rows = torch.randn(m, k, generator=gen)
        place = int(torch.randint(0, m, (1,), generator=gen))
        rows[place] = x[0]
        batched.append((m, fn(rows, weight, bias)[place]))
    return alone, batched


@needs_kernel
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_c_kernel_row_is_independent_of_its_batch(k, n, threads, lanes):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone, batched = rows_alone_and_batched(c_linear.invariant_linear, k, n)
    finally:
        torch.set_num_threads(old)
    for m, row in batched:
        assert torch.equal(row, alone), f"row differs among {m} rows"


@needs_kernel
def test_c_kernel_same_result_on_one_and_two_threads(lanes):
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(37, 576, generator=gen), torch.randn(300, 576, generator=gen)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = c_linear.invariant_linear(x, w)
        torch.set_num_threads(2)
        two = c_linear.invariant_linear(x, w)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, two)


@needs_kernel
@pytest.mark.parametrize("k,n", SHAPES)
def test_c_kernel_is_close_to_the_exact_product(k, n, lanes):
    gen = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(19, k, generator=gen), torch.randn(n, k, generator=gen), torch.randn(n, generator=gen)
    exact = F.linear(x.double(), w.double(), b.double())
    got = c_linear.invariant_linear(x, w, b)
    # fp32 sums of k products of unit normals: error ~ sqrt(k) ulp of the partial sums' size.
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=1e-6 * k ** 0.5 * 8)
    assert torch.equal(c_linear.invariant_linear(x, w), c_linear.invariant_linear(x, w, torch.zeros(n)))


def test_fits_refuses_what_the_kernel_cannot_take():
    w = torch.randn(8, 64)
    assert c_linear.fits(torch.randn(3, 64), w, None)
    assert not c_linear.fits(torch.randn(3, 40), torch.randn(8, 40), None)      # K not a multiple of 16
    assert not c_linear.fits(torch.randn(3, 64).double(), w.double(), None)
    assert not c_linear.fits(torch.randn(64, 3).t(), w, None)                    # not unit stride along K
    assert c_linear.invariant_linear(torch.randn(3, 40), torch.randn(8, 40)) is None


@pytest.mark.parametrize("k,n", [(40, 24), (100, 7)])
def test_tiled_fallback_row_is_independent_of_its_batch(k, n):
    """K not a multiple of 16: F.linear over zero-padded tiles of one shape (relies on the BLAS being deterministic
    for a fixed shape, which this checks on the host)."""
    alone, batched = rows_alone_and_batched(invariant_linear, k, n)
    for m, row in batched:
        assert torch.equal(row, alone), f"row differs among {m} rows (tile {INVARIANT_ROW_TILE})"
    x, w = torch.randn(5, 2, 3, k), torch.randn(n, k)
    assert invariant_linear(x, w).shape == (5, 2, 3, n)



@pytest.mark.parametrize("width", [64, 576, 49152])
def test_row_wise_reductions_are_independent_of_the_row_count(width):
    """What the mode leaves to torch: RMSNorm (with its residual add) and log-softmax, a row alone vs among others,
    on two threads (where a reduction could be split differently for few rows)."""
    from deepserve.layers.norm import add_rms_norm
    weight = torch.rand(width) + 0.5
    ops = {"rms_norm": lambda x: add_rms_norm(x, x * 0.5, weight, 1e-6)[0],
           "log_softmax": lambda x: torch.log_softmax(x, dim=-1)}
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for name, op in ops.items():
            alone, batched = rows_alone_and_batched(lambda x, w, b: op(x), width, 1)
            for m, row in batched:
                assert torch.equal(row, alone), f"{name}: row differs among {m} rows"
    finally:
        torch.set_num_threads(old)
