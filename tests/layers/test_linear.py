"""`linear` / `apply_linear` writing into a caller's buffer (a CUDA graph's static logits): the same values as
without it, on every path (cuBLAS's product straight into the buffer, the others copied)."""

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
