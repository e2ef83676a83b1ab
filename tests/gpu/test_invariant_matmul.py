"""The batch-invariant GPU matmul (kernels/invariant_matmul.py): a row's bits do not depend on how many rows are
beside it or where it sits; the values agree with torch's matmul."""

from __future__ import annotations

import pytest
import torch

from conftest import kernel_device
from deepserve.kernels.invariant_matmul import invariant_linear, invariant_linear_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_are_bitwise_the_same_alone_and_in_any_batch(dtype):
    device = kernel_device()
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("bf16 matrix products are wrong in Triton's interpreter")
    torch.manual_seed(0)
    k, n = 200, 96
    x = torch.randn(70, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype)
    full = invariant_linear(x, w, b)
    for m in (1, 3, 17, 64):
        assert torch.equal(invariant_linear(x[:m], w, b), full[:m])
    perm = torch.randperm(70, device=device)
    assert torch.equal(invariant_linear(x[perm], w, b), full[perm])
    ref = invariant_linear_ref(x.float(), w.float(), b.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(full.float(), ref, rtol=tol, atol=tol)
