"""The batch-1 GEMV against F.linear in float32 on the same values (exact products, another summation order: within
one rounding of the output dtype), its tiling rule, and the Linear layer's dispatch."""

import pytest
import torch
from torch import nn

from deepserve.kernels.activation import silu_and_mul
from deepserve.kernels.gemv import gemv, gemv_config, swiglu_gemv
from deepserve.layers import linear as linear_module
from deepserve.layers.linear import Linear, fused_swiglu_linear, linear
from deepserve.layers.mlp import GatedMLP, swiglu_activation

from kernel_testing import DTYPES, assert_within_ulps, skip_bf16_in_interpreter


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(1, 16), (7, 40), (33, 1100), (300, 64), (64, 513)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_linear(device, dtype, n, k, with_bias):
    skip_bf16_in_interpreter(dtype)
    x = torch.randn(1, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) * k ** -0.5).to(dtype)
    bias = torch.randn(n, device=device).to(dtype) if with_bias else None
    out = gemv(x, w, bias)
    ref = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float()).to(dtype)
    assert out.shape == (1, n) and out.dtype == dtype
    scale = (x.float().abs() @ w.float().abs().t()).max().item()
    assert_within_ulps(out, ref, dtype, ulps=1, min_exact=0.9, atol=2.0 ** -20 * scale)


def test_gemv_strided_row(device):
    x = torch.randn(3, 2 * 48, device=device).half()[1:2, ::2]           # one row, stride 2 along K
    w = torch.randn(20, 48, device=device).half()
    ref = torch.nn.functional.linear(x.float(), w.float()).half()
    assert_within_ulps(gemv(x, w), ref, torch.float16, ulps=1, min_exact=0.9, atol=1e-5)


def test_gemv_tiles():
    """Wide matrices (N >= 2K: gate/up, LM heads) take 4 rows and 1 warp, the rest 2 rows and 2 warps; K steps of
    512 elements, fewer for short rows (tuned on an H200: benchmarks/tune_gemv_2d.json)."""
    assert gemv_config(16384, 2048) == (4, 512, 1) and gemv_config(128256, 2048) == (4, 512, 1)
    assert gemv_config(3072, 2048) == (2, 512, 2) and gemv_config(2048, 8192) == (2, 512, 2)
    assert gemv_config(7, 40) == (2, 64, 2)


def test_linear_dispatch(device, monkeypatch):
    """One row of a half-precision activation goes to the GEMV; more rows, float32, or autograd stay on F.linear."""
    calls = []
    monkeypatch.setattr(linear_module, "use_triton", lambda x: True)
    import deepserve.kernels.gemv as gemv_module
    real = gemv_module.gemv
    monkeypatch.setattr(gemv_module, "gemv", lambda *a: calls.append(1) or real(*a))
    layer = Linear(40, 24, bias=True).to(device).half()
    ref_layer = nn.Linear(40, 24, bias=True).to(device).half()
    ref_layer.load_state_dict(layer.state_dict())
    x = torch.randn(1, 40, device=device).half()
    with torch.inference_mode():
        out = layer(x)
        assert len(calls) == 1
        assert_within_ulps(out, ref_layer(x.float().half()), torch.float16, ulps=1, min_exact=0.9, atol=1e-4)
        layer(torch.randn(2, 40, device=device).half())                  # two rows
        linear(x.float(), layer.weight.float())                         # float32
    assert len(calls) == 1
    layer(x)                                                             # autograd on
    assert len(calls) == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter,k", [(1, 16), (5, 40), (48, 1100), (300, 64)])
@pytest.mark.parametrize("limit", [None, 0.5])
def test_swiglu_gemv_is_the_gemv_then_the_activation(device, dtype, inter, k, limit):
    """One launch = the GEMV, its output rounded to the dtype, then the SwiGLU as the unfused path computes it (the
    SiLU-and-mul kernel's arithmetic; with a limit, swiglu_activation's clamps): the same bits, so that a batch-1
    step samples what a batched step samples (tests/gpu/test_engine_gpu.py checks that). And within the reference's
    roundings of the float32 product."""
    skip_bf16_in_interpreter(dtype)
    x = torch.randn(1, k, device=device).to(dtype)
    w13 = (torch.randn(2 * inter, k, device=device) * k ** -0.5).to(dtype)
    out = swiglu_gemv(x, w13, limit)
    assert out.shape == (1, inter) and out.dtype == dtype
    gate_up = gemv(x, w13)
    if limit is None:     # equal up to a GEMV summation that lands on the other side of a rounding
        assert_within_ulps(out, silu_and_mul(gate_up), dtype, ulps=1, min_exact=0.99)
    ref = swiglu_activation(torch.nn.functional.linear(x.float(), w13.float()).to(dtype), limit)
    assert_within_ulps(out, ref, dtype, ulps=2, min_exact=0.8, atol=2.0 ** -14)


def test_gated_mlp_fuses_only_one_row_through_a_plain_linear(device, monkeypatch):
    monkeypatch.setattr(linear_module, "use_triton", lambda x: True)
    mlp = GatedMLP(40, 24).to(device).half()
    x = torch.randn(1, 40, device=device).half()
    with torch.inference_mode():
        fused = fused_swiglu_linear(x, mlp.gate_up_proj, None)
        assert fused is not None and fused.shape == (1, 24)
        assert fused_swiglu_linear(torch.randn(2, 40, device=device).half(), mlp.gate_up_proj, None) is None
        plain = nn.Linear(40, 48, bias=False).to(device).half()
        assert fused_swiglu_linear(x, plain, None) is None                 # e.g. a quantized stand-in
        out = mlp(x)
        # The unfused path: the gate/up GEMM, the activation, the down GEMM (only summation orders differ).
        gate_up = torch.nn.functional.linear(x, mlp.gate_up_proj.weight)
        ref = torch.nn.functional.linear(swiglu_activation(gate_up, None), mlp.down_proj.weight)
    assert_within_ulps(out, ref, torch.float16, ulps=2, min_exact=0.5, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_a,n_b,k", [(3072, 576, 2048), (7, 33, 40), (64, 1, 513)])
def test_gemv_two_matches_two_linears(device, dtype, n_a, n_b, k):
    """Two projections of one row in one launch: each output as F.linear in float32 (within one rounding), and
    bitwise what `gemv` gives each matrix under the same tiling."""
    skip_bf16_in_interpreter(dtype)
    from deepserve.kernels.gemv import gemv_two, gemv_with
    x = torch.randn(1, k, device=device).to(dtype)
    w_a = (torch.randn(n_a, k, device=device) * k ** -0.5).to(dtype)
    w_b = (torch.randn(n_b, k, device=device) * k ** -0.5).to(dtype)
    y_a, y_b = gemv_two(x, w_a, w_b)
    tiling = gemv_config(n_a + n_b, k)
    for y, w in ((y_a, w_a), (y_b, w_b)):
        ref = torch.nn.functional.linear(x.float(), w.float()).to(dtype)
        scale = (x.float().abs() @ w.float().abs().t()).max().item()
        assert_within_ulps(y, ref, dtype, ulps=1, min_exact=0.9, atol=2.0 ** -20 * scale)
        assert torch.equal(y, gemv_with(x, w, None, *tiling))


def test_fused_two_linear_dispatch(device, monkeypatch):
    """One launch for two plain bias-free Linears of one half-precision row on the GPU; None (the caller applies
    them one by one) with a bias, more rows, or float32."""
    from deepserve.layers.linear import fused_two_linear
    monkeypatch.setattr(linear_module, "use_triton", lambda x: True)
    a, b = Linear(40, 24, bias=False).to(device).half(), Linear(40, 8, bias=False).to(device).half()
    x = torch.randn(1, 40, device=device).half()
    with torch.inference_mode():
        both = fused_two_linear(x, a, b)
        assert both is not None and both[0].shape == (1, 24) and both[1].shape == (1, 8)
        assert fused_two_linear(torch.randn(2, 40, device=device).half(), a, b) is None
        assert fused_two_linear(x, a, Linear(40, 8, bias=True).to(device).half()) is None
        assert fused_two_linear(x.float(), a.float(), b.float()) is None
