"""The batch-1 GEMV against F.linear in float32 on the same values (exact products, another summation order: within
one rounding of the output dtype), its tiling rule, and the Linear layer's dispatch."""

import pytest
import torch
from torch import nn

from deepserve.kernels.activation import silu_and_mul
from deepserve.kernels import gemv as gemv_module
from deepserve.kernels.gemv import gemv, gemv_config, parse_gemv_tiling, swiglu_gemv
from deepserve.kernels.skinny_gemm import WIDE_MAX_ROWS, WIDE_ROWS, skinny_max_rows, skinny_wide_tiles
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
    """Many rows (N >= 8192: gate/up, LM heads): 4 rows, K steps of 512, 1 warp; long rows (K > 2048: down
    projections): 1 row, steps of 512, 4 warps; the rest: 4 rows in one K step, 4 warps (tuned on an H200:
    benchmarks/tune_gemv_wide.json)."""
    assert gemv_config(16384, 2048) == (4, 512, 1) and gemv_config(128256, 2048) == (4, 512, 1)
    assert gemv_config(2048, 8192) == (1, 512, 4) and gemv_config(2048, 2816) == (1, 512, 4)
    assert gemv_config(3072, 2048) == (4, 2048, 4) and gemv_config(576, 2048) == (4, 2048, 4)
    assert gemv_config(7, 40) == (4, 64, 4)


@pytest.mark.parametrize("tiling", ["long_rows=1x1024x4;short_rows=1x1024x4;many_rows=1x1024x4",
                                    "long_rows=2x256x2;short_rows=8x64x8;many_rows=8x64x8"])
def test_gemv_tiling_override_keeps_the_products(device, monkeypatch, tiling):
    """DEEPSERVE_GEMV_TILING's tilings (benchmarks/tune_gemv.py's grid) give the plain and the SwiGLU GEMV the same
    products within one rounding, on short and long rows and rows that no tile divides."""
    monkeypatch.setattr(gemv_module, "TILING_OVERRIDES", parse_gemv_tiling(tiling))
    for n, k in [(7, 40), (33, 1100), (64, 2500)]:
        x = torch.randn(1, k, device=device).half()
        w = (torch.randn(n, k, device=device) * k ** -0.5).half()
        ref = torch.nn.functional.linear(x.float(), w.float()).half()
        scale = (x.float().abs() @ w.float().abs().t()).max().item()
        assert_within_ulps(gemv(x, w), ref, torch.float16, ulps=1, min_exact=0.9, atol=2.0 ** -20 * scale)
        act = swiglu_gemv(x, w[: n - n % 2])
        ref_act = swiglu_activation(torch.nn.functional.linear(x.float(), w[: n - n % 2].float()).half(), None)
        assert_within_ulps(act, ref_act, torch.float16, ulps=2, min_exact=0.8, atol=2.0 ** -14)


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


@pytest.mark.parametrize("rows", [1, 4])
def test_linear_writes_the_triton_product_into_out(device, monkeypatch, rows):
    """`linear(..., out=)` (a CUDA graph's LM head into its static logits): the GEMV (one row) and the skinny GEMM
    (a few) write the product into `out` itself, bit for bit what they return without it; an `out` that is not
    contiguous gets a copy."""
    monkeypatch.setattr(linear_module, "use_triton", lambda x: True)
    x = torch.randn(rows, 64, device=device).half()
    w = (torch.randn(300, 64, device=device) * 0.125).half()
    with torch.inference_mode():
        want = linear(x, w)
        buffer = torch.full((rows, 300), float("nan"), device=device).half()
        got = linear(x, w, out=buffer)
        assert got.data_ptr() == buffer.data_ptr() and torch.equal(buffer, want)
        strided = torch.full((300, rows), float("nan"), device=device).half().t()
        assert torch.equal(linear(x, w, out=strided), want) and torch.equal(strided, want)


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
        # More rows: the skinny GEMM's (tests/gpu/test_skinny_gemm.py) up to skinny_max_rows, or WIDE_MAX_ROWS for
        # the gate/up weights it takes past 32 rows (DEEPSERVE_SKINNY_64_ROWS), None beyond.
        wide = WIDE_ROWS and skinny_wide_tiles(48, 40, swiglu=True) is not None     # gate_up: 48 x 40
        too_many = (WIDE_MAX_ROWS if wide else skinny_max_rows(48, 40)) + 1
        assert fused_swiglu_linear(torch.randn(too_many - 1, 40, device=device).half(), mlp.gate_up_proj,
                                   None) is not None
        assert fused_swiglu_linear(torch.randn(too_many, 40, device=device).half(), mlp.gate_up_proj, None) is None
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
    """One launch for two plain bias-free Linears of half-precision rows on the GPU (the GEMV for one row, the
    skinny GEMM for a few); None (the caller applies them one by one) with a bias, too many rows, or float32."""
    from deepserve.layers.linear import fused_two_linear
    monkeypatch.setattr(linear_module, "use_triton", lambda x: True)
    a, b = Linear(40, 24, bias=False).to(device).half(), Linear(40, 8, bias=False).to(device).half()
    x = torch.randn(1, 40, device=device).half()
    with torch.inference_mode():
        both = fused_two_linear(x, a, b)
        assert both is not None and both[0].shape == (1, 24) and both[1].shape == (1, 8)
        few = fused_two_linear(torch.randn(2, 40, device=device).half(), a, b)
        assert few is not None and few[0].shape == (2, 24) and few[1].shape == (2, 8)
        assert fused_two_linear(torch.randn(40, 40, device=device).half(), a, b) is None
        assert fused_two_linear(x, a, Linear(40, 8, bias=True).to(device).half()) is None
        assert fused_two_linear(x.float(), a.float(), b.float()) is None


class _Norm(nn.Module):
    """An RMSNorm's two fields, as the GEMVs read them."""

    def __init__(self, k, dtype, device, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter((1 + 0.3 * torch.randn(k, device=device)).to(dtype), requires_grad=False)
        self.eps = eps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,k", [(7, 40), (33, 1100), (300, 64), (64, 2048), (40, 3000)])
@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemv_norm_prologue_and_residual_epilogue(device, dtype, n, k, with_norm, with_residual):
    """gemv(x, w, residual=r, norm=n) is the three-launch path (the RMSNorm kernel, the GEMV, the add) in one:
    within one rounding of it (the norm's sum of squares runs in another order), and within the float32
    reference's roundings. K = 3000 takes several K steps: the norm then runs as its own kernel first."""
    skip_bf16_in_interpreter(dtype)
    from deepserve.kernels.gemv import gemv_ref
    from deepserve.kernels.norm import fused_add_rms_norm
    x = (3 * torch.randn(1, k, device=device)).to(dtype)
    w = (torch.randn(n, k, device=device) * k ** -0.5).to(dtype)
    norm = _Norm(k, dtype, device) if with_norm else None
    residual = torch.randn(1, n, device=device).to(dtype) if with_residual else None
    out = gemv(x, w, residual=residual, norm=norm)
    assert out.shape == (1, n) and out.dtype == dtype
    unfused = gemv(fused_add_rms_norm(x, None, norm.weight, norm.eps) if with_norm else x, w)
    if with_residual:
        unfused = unfused + residual
    assert_within_ulps(out, unfused, dtype, ulps=1, min_exact=0.9, atol=1e-5)
    ref = gemv_ref(x.float(), w.float(), None, None if residual is None else residual.float(),
                   None if norm is None else _float_norm(norm)).to(dtype)
    # The float32 reference skips the norm's roundings: a tolerance, no share of equal bits.
    assert_within_ulps(out, ref, dtype, ulps=2, min_exact=0.0, atol=2e-2)


def _float_norm(norm):
    n = _Norm(norm.weight.shape[0], torch.float32, norm.weight.device, norm.eps)
    n.weight.data.copy_(norm.weight.float())
    return n


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter,k", [(5, 40), (48, 1100), (64, 2048), (4100, 256)])
def test_swiglu_gemv_norm_prologue(device, dtype, inter, k):
    """swiglu_gemv(x, w13, norm=n) = swiglu_gemv of the RMSNorm kernel's output, within one rounding."""
    skip_bf16_in_interpreter(dtype)
    from deepserve.kernels.norm import fused_add_rms_norm
    x = (3 * torch.randn(1, k, device=device)).to(dtype)
    w13 = (torch.randn(2 * inter, k, device=device) * k ** -0.5).to(dtype)
    norm = _Norm(k, dtype, device)
    out = swiglu_gemv(x, w13, norm=norm)
    unfused = swiglu_gemv(fused_add_rms_norm(x, None, norm.weight, norm.eps), w13)
    assert_within_ulps(out, unfused, dtype, ulps=1, min_exact=0.9, atol=1e-5)


def test_linear_residual_dispatch(device, monkeypatch):
    """The add goes into the GEMV's epilogue for one row through a plain Linear; elsewhere it is a separate add,
    with the same result up to the GEMV's summation order."""
    from deepserve.layers.linear import linear_residual
    monkeypatch.setattr(linear_module, "use_triton", lambda x: True)
    layer = Linear(40, 24, bias=False).to(device).half()
    x = torch.randn(1, 40, device=device).half()
    r = torch.randn(1, 24, device=device).half()
    with torch.inference_mode():
        out = linear_residual(x, layer, r)
        ref = torch.nn.functional.linear(x.float(), layer.weight.float()).half() + r
        assert_within_ulps(out, ref, torch.float16, ulps=1, min_exact=0.9, atol=1e-4)
        two = linear_residual(torch.randn(2, 40, device=device).half(), layer, torch.zeros(2, 24, device=device).half())
        assert two.shape == (2, 24)
