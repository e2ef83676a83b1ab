"""The C rotary embedding (deepserve/kernels/cpu/rotary.c) against the PyTorch reference of the layer that calls
it. Tolerance: a few float32 ulps (the compiler may fuse a multiply and an add)."""

import pytest
import torch

from deepserve.kernels.cpu import rotary
from deepserve.kernels.reference.rotary import apply_rotate_half
from deepserve.layers.rotary import RotaryEmbedding

needs_kernels = pytest.mark.skipif(rotary._library() is None, reason="no C compiler or DEEPSERVE_CPU_KERNELS=0")


def _close(out, ref):
    err = (out - ref).abs().max().item()
    assert err <= 1e-6 * max(1.0, ref.abs().max().item()), f"max error {err:.3g}"


@needs_kernels
@pytest.mark.parametrize("t,heads,dim", [(1, 12, 64), (7, 3, 128), (40, 5, 32)])
def test_rotary_matches_reference(t, heads, dim):
    torch.manual_seed(t * heads)
    rot = RotaryEmbedding(dim, 2048, 10000.0)
    x = torch.randn(t, heads, 2 * dim)[..., :dim]     # strided heads, as q/k slices of the qkv output
    pos = torch.randint(0, 2048, (t,))
    out = rotary.rotate_half(pos, x, rot.cos_cache, rot.sin_cache)
    _close(out, apply_rotate_half(x, rot.cos_cache[pos].unsqueeze(1), rot.sin_cache[pos].unsqueeze(1)))
    assert out.is_contiguous() and out.shape == x.shape


@needs_kernels
def test_layer_uses_it_and_agrees_with_the_torch_path():
    rot = RotaryEmbedding(64, 512, 10000.0)
    q, k, pos = torch.randn(5, 9, 64), torch.randn(5, 3, 64), torch.tensor([0, 1, 7, 100, 511])
    with torch.inference_mode():
        q_rot, k_rot = rot(pos, q, k)
    _close(q_rot, apply_rotate_half(q, rot.cos_cache[pos].unsqueeze(1), rot.sin_cache[pos].unsqueeze(1)))
    _close(k_rot, apply_rotate_half(k, rot.cos_cache[pos].unsqueeze(1), rot.sin_cache[pos].unsqueeze(1)))


@needs_kernels
def test_rotary_rejects_positions_outside_the_cache():
    rot = RotaryEmbedding(16, 8, 10000.0)
    with pytest.raises(IndexError):
        rotary.rotate_half(torch.tensor([3, 8]), torch.randn(2, 1, 16), rot.cos_cache, rot.sin_cache)


@needs_kernels
def test_rotary_bound_check_sees_in_place_changes():
    """The bounds check is cached per positions tensor; writing into that tensor must invalidate it."""
    rot = RotaryEmbedding(16, 8, 10000.0)
    pos, x = torch.tensor([1, 2]), torch.randn(2, 1, 16)
    rotary.rotate_half(pos, x, rot.cos_cache, rot.sin_cache)
    pos[1] = 8
    with pytest.raises(IndexError):
        rotary.rotate_half(pos, x, rot.cos_cache, rot.sin_cache)


def test_other_dtypes_and_autograd_fall_back():
    rot = RotaryEmbedding(16, 8, 10000.0)
    pos = torch.tensor([1])
    assert rotary.rotate_half(pos, torch.randn(1, 1, 16, dtype=torch.float64), rot.cos_cache.double(),
                              rot.sin_cache.double()) is None
    x = torch.randn(1, 1, 16, requires_grad=True)
    assert rotary.rotate_half(pos, x, rot.cos_cache, rot.sin_cache) is None      # autograd cannot see through C
