"""`linear` / `apply_linear` writing into a caller's buffer (a CUDA graph's static logits): the same values as
without it, on every path (cuBLAS's product straight into the buffer, the others copied); the C kernel that takes
few float32 rows on the CPU."""

import torch
from torch import nn

from deepserve.layers.linear import Linear, apply_linear, linear


def test_linear_into_a_buffer_is_the_plain_product():
    torch.manual_seed(0)
    x, w = torch.randn(40, 64), torch.randn(96, 64)
    buffer = torch.full((48, 96), float("nan"))
    out = linear(x, w, out=buffer[:40])
    assert out.data_ptr() == buffer.data_ptr()
    assert torch.equal(buffer[:40], torch.nn.functional.linear(x, w))
    assert buffer[40:].isnan().all()            # rows past the batch untouched


def test_linear_into_a_buffer_with_bias_or_invariant_mode_copies():
    torch.manual_seed(1)
    x, w, b = torch.randn(5, 32), torch.randn(24, 32), torch.randn(24)
    out = torch.empty(5, 24)
    assert torch.equal(linear(x, w, b, out=out), torch.nn.functional.linear(x, w, b))
    out = torch.empty(5, 24)
    assert torch.equal(linear(x, w, batch_invariant=True, out=out), linear(x, w, batch_invariant=True))


def test_apply_linear_takes_any_layer():
    torch.manual_seed(2)
    plain = Linear(32, 24, bias=False)
    other = nn.Sequential(nn.Linear(32, 24))    # not a Linear: called, then copied
    x = torch.randn(7, 32)
    for layer in (plain, other):
        out = torch.empty(7, 24)
        with torch.inference_mode():
            assert apply_linear(layer, x, out) is out
            assert torch.equal(out, layer(x))
            assert torch.equal(apply_linear(layer, x), layer(x))


def test_few_float32_rows_on_the_cpu_take_the_c_kernel(monkeypatch):
    """1-32 float32 rows on the CPU, no autograd: kernels/cpu/invariant_linear.c (F.linear's product up to the order
    of the sums); more rows, another dtype, autograd or DEEPSERVE_CPU_FEW_ROW_LINEAR=0: F.linear; K not a multiple
    of 16: the kernel refuses and F.linear answers."""
    import pytest
    from deepserve.kernels.cpu import invariant_linear as kernel
    from deepserve.layers import linear as linear_module
    if kernel._library() is None:
        pytest.skip("no C kernel library (no compiler, or DEEPSERVE_CPU_KERNELS=0)")
    calls = []
    real = kernel.invariant_linear
    monkeypatch.setattr(kernel, "invariant_linear", lambda *a: calls.append(a[0].shape) or real(*a))
    torch.manual_seed(3)
    w, b = torch.randn(300, 64), torch.randn(300)
    with torch.inference_mode():
        for rows in (1, 7, 32):
            x = torch.randn(rows, 64)
            torch.testing.assert_close(linear(x, w, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
        assert calls == [(1, 64), (7, 64), (32, 64)]
        x33 = torch.randn(33, 64)
        assert torch.equal(linear(x33, w, b), torch.nn.functional.linear(x33, w, b))
        xh, wh = torch.randn(4, 64, dtype=torch.bfloat16), w.bfloat16()
        assert torch.equal(linear(xh, wh), torch.nn.functional.linear(xh, wh))
        odd_x, odd_w = torch.randn(3, 40), torch.randn(20, 40)       # K = 40: the kernel returns None
        assert torch.equal(linear(odd_x, odd_w), torch.nn.functional.linear(odd_x, odd_w))
        assert len(calls) == 4
    x = torch.randn(2, 64)
    assert torch.equal(linear(x, w, b), torch.nn.functional.linear(x, w, b))     # autograd on
    monkeypatch.setattr(linear_module, "_CPU_FEW_ROWS", 0)
    with torch.inference_mode():
        assert torch.equal(linear(x, w, b), torch.nn.functional.linear(x, w, b))
    assert len(calls) == 4
