"""Fused add + RMSNorm, rotary embedding and SiLU-and-mul against their PyTorch twins (the engine's layers)."""

import pytest
import torch

from deepserve.kernels.activation import silu_and_mul, silu_and_mul_ref
from deepserve.layers.kernel_dispatch import use_triton
from deepserve.kernels.fused_moe import moe_combine
from deepserve.kernels.norm import (combine_add_rms_norm, combine_add_rms_norm_ref, fused_add_rms_norm,
                                    fused_add_rms_norm_ref)
from deepserve.kernels.reference.moe import PairRows
from deepserve.layers.norm import RMSNorm
from deepserve.kernels.rotary import apply_rotary, apply_rotary_ref, rotate, rotate_ref
from deepserve.layers.rotary import RotaryEmbedding
from kernel_testing import DTYPES, assert_within_ulps, skip_bf16_in_interpreter

pytestmark = pytest.mark.gpu


# --- RMSNorm ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 4096), (7, 2048), (33, 1000), (130, 5120), (3, 576)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(device, dtype, rows, hidden, with_residual):
    skip_bf16_in_interpreter(dtype)
    x = (torch.randn(rows, hidden, device=device) * 3).to(dtype)
    res = torch.randn(rows, hidden, device=device).to(dtype) if with_residual else None
    w = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    out = fused_add_rms_norm(x, res, w, 1e-6)
    ref = fused_add_rms_norm_ref(x, res, w, 1e-6)
    if with_residual:
        assert torch.equal(out[1], ref[1])          # x + residual: one rounding, bit-identical
        out, ref = out[0], ref[0]
    # The normalised value and the weight product are each rounded once: two roundings apart at most.
    assert_within_ulps(out, ref, dtype, ulps=2, min_exact=0.98)


def test_rms_norm_float32_weight_promotes(device):
    skip_bf16_in_interpreter(torch.bfloat16)
    x = torch.randn(5, 256, device=device).to(torch.bfloat16)
    w = 1 + 0.1 * torch.randn(256, device=device)
    out = fused_add_rms_norm(x, None, w, 1e-5)
    ref = fused_add_rms_norm_ref(x, None, w, 1e-5)
    assert out.dtype == ref.dtype == torch.float32
    assert_within_ulps(out.to(torch.bfloat16), ref.to(torch.bfloat16), torch.bfloat16, ulps=1, min_exact=0.98)


def test_rms_norm_3d_and_strided(device):
    x = torch.randn(4, 3, 2 * 640, device=device).half()[..., :640]   # non-contiguous rows
    res = torch.randn(4, 3, 640, device=device).half()
    w = torch.randn(640, device=device).half()
    out, new_res = fused_add_rms_norm(x, res, w, 1e-6)
    ref, ref_res = fused_add_rms_norm_ref(x, res, w, 1e-6)
    assert out.shape == (4, 3, 640) and torch.equal(new_res, ref_res)
    assert_within_ulps(out, ref, torch.float16, ulps=2, min_exact=0.98)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,top_k,hidden", [(1, 8, 2048), (37, 8, 2048), (5, 2, 1000), (9, 1, 576), (0, 6, 64)])
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "with-shared"])
def test_combine_add_rms_norm_is_the_combine_then_the_norm(device, dtype, tokens, top_k, hidden, shared):
    """A MoE layer's pair rows summed inside the add + RMSNorm (DEEPSERVE_MOE_COMBINE_IN_NORM): bit for bit the
    combine kernel's output put through the add + norm kernel, both outputs (normed, new residual stream); and
    within the norm's two roundings of the PyTorch twin."""
    skip_bf16_in_interpreter(dtype)
    pairs = PairRows((torch.randn(tokens * top_k, hidden, device=device) * 2).to(dtype), top_k,
                     torch.randn(tokens, hidden, device=device).to(dtype) if shared else None)
    res = torch.randn(tokens, hidden, device=device).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    out, stream = combine_add_rms_norm(pairs, res, w, 1e-6)
    two_launches = fused_add_rms_norm(moe_combine(pairs.pair_out, top_k, pairs.shared_out), res, w, 1e-6)
    assert torch.equal(out, two_launches[0]) and torch.equal(stream, two_launches[1])
    assert out.shape == stream.shape == (tokens, hidden)
    ref, ref_stream = combine_add_rms_norm_ref(pairs, res, w, 1e-6)
    assert torch.equal(stream, ref_stream)             # slot-order float32 sum, one rounding, then the add's
    if tokens:
        assert_within_ulps(out, ref, dtype, ulps=2, min_exact=0.98)
    # RMSNorm takes the pairs where it would take the layer's output, and the selected rows of them (the kernel on a
    # CUDA tensor, the PyTorch twin elsewhere: under the interpreter).
    norm = RMSNorm(hidden, 1e-6).to(device)
    norm.weight.data = w.clone()
    want = (out, stream) if use_triton(res) else (ref, ref_stream)
    rows = torch.arange(tokens, device=device)[1::2]
    with torch.no_grad():
        got, picked = norm(pairs, res), norm(pairs[rows], res[rows])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(picked[0], want[0][rows]) and torch.equal(picked[1], want[1][rows])


# --- rotary -------------------------------------------------------------------------------------
ROPE_SCALINGS = [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (12, 12), (7, 1)])
@pytest.mark.parametrize("scaling", ROPE_SCALINGS, ids=["default", "llama3"])
def test_rotary_matches_reference(device, dtype, head_dim, heads, kv_heads, scaling):
    skip_bf16_in_interpreter(dtype)
    rope = RotaryEmbedding(head_dim, 16384, 500000.0, scaling).to(device)
    t = 37
    positions = torch.randint(0, 16384, (t,), device=device)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, device=device).to(dtype)
    q = qkv[:, :heads * head_dim].view(t, heads, head_dim)                           # strided views
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    # The PyTorch twin is the reference: on a CUDA tensor the layer itself dispatches to the kernel.
    ref_q, ref_k = apply_rotary_ref(positions, q, k, rope.cos_cache, rope.sin_cache)
    out_q, out_k = apply_rotary(positions, q, k, rope.cos_cache, rope.sin_cache)
    # x1*cos - x2*sin may be contracted into one fused multiply-add: a float32 difference of about 2**-23 of the
    # products, visible only where the two products cancel (results near 0).
    atol = 2.0 ** -21 * qkv.float().abs().max().item()
    assert_within_ulps(out_q, ref_q, dtype, ulps=1, min_exact=0.99, atol=atol)
    assert_within_ulps(out_k, ref_k, dtype, ulps=1, min_exact=0.99, atol=atol)
    # In place, on contiguous copies.
    q2, k2 = q.contiguous(), k.contiguous()
    r_q, r_k = apply_rotary(positions, q2, k2, rope.cos_cache, rope.sin_cache, inplace=True)
    assert r_q.data_ptr() == q2.data_ptr() and torch.equal(q2, out_q) and torch.equal(k2, out_k)
    layer_q, layer_k = rope(positions, q, k)
    if use_triton(q):
        assert torch.equal(layer_q, out_q) and torch.equal(layer_k, out_k)     # the layer runs the kernel
    else:
        assert torch.equal(layer_q, ref_q) and torch.equal(layer_k, ref_k)     # interpreter: the layer's torch path
    # q and k heads side by side in one tensor (what the Llama layer rotates): one pass.
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(t, heads + kv_heads, head_dim)
    out_qk = rotate(positions, qk, rope.cos_cache, rope.sin_cache)
    assert torch.equal(out_qk, torch.cat([out_q, out_k], dim=1))
    assert_within_ulps(out_qk, rotate_ref(positions, qk, rope.cos_cache, rope.sin_cache), dtype, ulps=1,
                       min_exact=0.99, atol=atol)
    assert torch.equal(rope.rotate(positions, qk), out_qk if use_triton(qk) else rotate_ref(
        positions, qk, rope.cos_cache, rope.sin_cache))


# --- SiLU-and-mul -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1000), (5, 11008), (33, 1536), (130, 14336)])
def test_silu_and_mul_matches_reference(device, dtype, rows, inter):
    skip_bf16_in_interpreter(dtype)
    x = (torch.randn(rows, 2 * inter, device=device) * 3).to(dtype)
    out = silu_and_mul(x)
    ref = silu_and_mul_ref(x)
    assert out.shape == (rows, inter)
    assert_within_ulps(out, ref, dtype, ulps=2, min_exact=0.99)


def test_silu_and_mul_3d(device):
    x = torch.randn(2, 3, 2 * 96, device=device).half()
    assert_within_ulps(silu_and_mul(x), silu_and_mul_ref(x), torch.float16, ulps=2, min_exact=0.99)
