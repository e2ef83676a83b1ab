"""The fused interleaved RoPE (deepserve/kernels/interleaved_rope.py) against its twin, rope_interleaved at table
positions: queries [T, nH, D] (strided views too), single-head keys [T, D], forward and inverse, float32 / float16
/ bfloat16. Elementwise float32 math rounded once, so the results are the twin's to a float32 ulp before that
rounding (the kernel may fuse a product and a sum into one FMA): within one ulp of the output dtype (plus an ulp
of the products where they cancel), and most half-precision elements bit-identical."""

import pytest
import torch

from deepserve.kernels import INTERPRET
from deepserve.kernels.interleaved_rope import rope_at_positions, rope_supported
from deepserve.kernels.reference.sparse_attention import rope_interleaved
from deepserve.layers.sparse_attention import InterleavedRope, Yarn
from kernel_testing import assert_within_ulps

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (rows, heads or None for [T, D], head dim, rope dim): V4.1's queries (64 x 512, R 64), its keys / compressed entries
# (512), indexer queries (32 x 128), a D that is not a power of two, rotary over the whole head.
SHAPES = [(5, 64, 512, 64), (7, None, 512, 64), (3, 32, 128, 64), (4, 3, 48, 16), (6, 2, 32, 32)]


def _twin(x, rope, positions, inverse):
    sin = rope.sin[positions]
    return rope_interleaved(x, rope.cos[positions], -sin if inverse else sin)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("inverse", [False, True])
def test_matches_the_twin(device, dtype, shape, inverse):
    rows, heads, dim, rope_dim = shape
    rope = InterleavedRope(rope_dim, 4096, 10000.0, Yarn(1024, 4.0, 32, 1)).to(device)
    x = torch.randn(rows, *((heads,) if heads else ()), dim, device=device).to(dtype)
    positions = torch.randint(0, 4096, (rows,), device=device)
    assert rope_supported(x, rope.cos, rope.sin, positions)
    out = rope_at_positions(x, rope.cos, rope.sin, positions, inverse)
    assert out.shape == x.shape and out.dtype == dtype
    # Bit-identical elements: float32 outputs show the FMA differences directly (not counted); Triton's interpreter
    # converts float32 to bfloat16 by truncation, not round-to-nearest (1 ulp apart often).
    min_exact = 0.0 if dtype == torch.float32 or (INTERPRET and dtype == torch.bfloat16) else 0.9
    # x0 cos - x1 sin can cancel: a fused multiply-add then differs from the twin's two rounded products by more
    # than an ulp of the (small) result, but not by more than an ulp of the products (|x| ~ 1: 2^-23).
    assert_within_ulps(out, _twin(x, rope, positions, inverse), dtype, min_exact=min_exact, atol=2.5e-7)
    assert torch.equal(out[..., :dim - rope_dim], x[..., :dim - rope_dim])      # pass-through dims untouched


def test_strided_rows_and_the_inverse_undoes_the_rotation(device):
    rope = InterleavedRope(64, 2048, 160000.0, None).to(device)
    base = torch.randn(9, 8, 512 + 32, device=device)
    x = base[::2, :, 16:16 + 512]                   # row and head strides that are not the packed ones
    positions = torch.arange(5, device=device) * 300
    out = rope_at_positions(x, rope.cos, rope.sin, positions)
    assert_within_ulps(out, _twin(x.contiguous(), rope, positions, False), torch.float32, atol=2.5e-7)
    back = rope_at_positions(out, rope.cos, rope.sin, positions, inverse=True)
    assert torch.allclose(back, x, atol=1e-5)
