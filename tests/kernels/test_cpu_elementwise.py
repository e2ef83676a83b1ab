"""The C RMSNorm, rotary and SiLU-and-mul (deepserve/kernels/cpu/elementwise.c) against the PyTorch references
of the layers that call them. Tolerance: a few float32 ulps (different summation order and libm)."""

import pytest
import torch
import torch.nn.functional as F

from deepserve.kernels.cpu import elementwise
from deepserve.layers.norm import RMSNorm, rms_norm
from deepserve.layers.rotary import RotaryEmbedding, _apply

needs_kernels = pytest.mark.skipif(elementwise._library() is None, reason="no C compiler or DEEPSERVE_CPU_KERNELS=0")


def _close(out, ref, rel=4e-7, abs_=1e-6):
    err = (out - ref).abs()
    assert err.max().item() <= abs_ + rel * ref.abs().max().item() * 8, f"max error {err.max().item():.3g}"


@needs_kernels
@pytest.mark.parametrize("rows,cols", [(1, 576), (7, 64), (33, 1000), (130, 576)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(rows, cols, with_residual):
    torch.manual_seed(rows + cols)
    x, res, w = torch.randn(rows, cols) * 3, torch.randn(rows, cols), 1 + 0.1 * torch.randn(cols)
    out = elementwise.rms_norm(x, res if with_residual else None, w, 1e-5)
    if with_residual:
        out, new_res = out
        assert torch.equal(new_res, x + res)        # one float32 add: exact
        x = x + res
    _close(out, rms_norm(x, w, 1e-5))


@needs_kernels
def test_rms_norm_strided_rows_and_3d():
    x = torch.randn(4, 3, 2 * 64)[..., :64]          # rows evenly strided but not contiguous
    w = torch.randn(64)
    _close(elementwise.rms_norm(x, None, w, 1e-6), rms_norm(x, w, 1e-6))
    # Rows that are not evenly strided cannot be one [rows, cols] view: None, the layer falls back to PyTorch
    x = x[:, :2]
    assert elementwise.rms_norm(x, None, w, 1e-6) is None
    layer = RMSNorm(64, 1e-6)
    with torch.no_grad():
        layer.weight.copy_(w)
        _close(layer(x), rms_norm(x, w, 1e-6))


@needs_kernels
@pytest.mark.parametrize("t,heads,dim", [(1, 12, 64), (7, 3, 128), (40, 5, 32)])
def test_rotary_matches_reference(t, heads, dim):
    torch.manual_seed(t * heads)
    rot = RotaryEmbedding(dim, 2048, 10000.0)
    x = torch.randn(t, heads, 2 * dim)[..., :dim]     # strided heads, as q/k slices of the qkv output
    pos = torch.randint(0, 2048, (t,))
    out = elementwise.rotate_half(pos, x, rot.cos_cache, rot.sin_cache)
    _close(out, _apply(x, rot.cos_cache[pos].unsqueeze(1), rot.sin_cache[pos].unsqueeze(1)))
    assert out.is_contiguous() and out.shape == x.shape


@needs_kernels
def test_rotary_rejects_positions_outside_the_cache():
    rot = RotaryEmbedding(16, 8, 10000.0)
    with pytest.raises(IndexError):
        elementwise.rotate_half(torch.tensor([3, 8]), torch.randn(2, 1, 16), rot.cos_cache, rot.sin_cache)


@needs_kernels
@pytest.mark.parametrize("rows,inter", [(1, 1536), (9, 100), (64, 8)])
def test_silu_and_mul_matches_reference(rows, inter):
    g = torch.randn(rows, 2 * inter) * 4
    _close(elementwise.silu_and_mul(g), F.silu(g[:, :inter]) * g[:, inter:])


def test_other_dtypes_and_autograd_fall_back():
    w = torch.ones(8)
    assert elementwise.rms_norm(torch.randn(2, 8, dtype=torch.float64), None, w.double(), 1e-6) is None
    assert elementwise.silu_and_mul(torch.randn(2, 8, dtype=torch.bfloat16)) is None
    x = torch.randn(2, 8, requires_grad=True)
    assert elementwise.rms_norm(x, None, w, 1e-6) is None       # autograd cannot see through C
