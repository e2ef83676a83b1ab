"""MLA's absorbed-decode weight products (W_UK into the query, W_UV onto the latent output) against the bmm pair
they replace, on W_UK / W_UV as views of one stacked kv_b (as LatentUpProjection.per_head builds them).

References in float64 on the same values (immune to TF32 settings). float32: within 1e-5 of sum |products| per
element (float32 products and summation in another order). bf16: one rounding of the float32 result, so within one
bf16 ulp of the exact product rounded once (and of the bf16 bmm); Triton's interpreter truncates float32 -> bf16
instead of rounding, which only lowers the share of bit-identical elements."""

import pytest
import torch

from deepserve.kernels import INTERPRET
from deepserve.kernels.mla_absorb import (MAX_ABSORB_BATCH, MAX_MMA_BATCH, absorb_query, absorb_query_ref,
                                          absorb_supported, expand_values, expand_values_ref, use_mma)
from deepserve.layers.mla import LatentUpProjection

from kernel_testing import assert_within_ulps, skip_bf16_in_interpreter

V2_LITE = (16, 128, 128, 512)                       # H, N (qk_nope_head_dim), V (v_head_dim), R (kv_lora_rank)
SHAPES = [(1, 128, 128, 512), V2_LITE, (3, 32, 32, 64)]
BATCHES = sorted({1, 2, 4, MAX_ABSORB_BATCH, 16, 100})   # past the caps too: every kernel handles any B (100: two
                                                          # row blocks of the tensor-core kernels, the last ragged)
KERNELS = [False, True]                                   # `mma`: the GEMVs, the tensor-core kernels
DTYPES = [torch.float32, torch.bfloat16]
# bf16 elements bit-identical to the once-rounded float32 result: nearly all on a GPU; about half in the
# interpreter (it truncates).
MIN_EXACT = 0.3 if INTERPRET else 0.9


def _kv_b(heads, nope, v_dim, rank, dtype, device):
    """(w_uk [H, N, R], w_uv [H, V, R]) as views of one kv_b [H * (N + V), R], scaled to outputs of order 1."""
    proj = LatentUpProjection(heads, nope, v_dim, rank)
    with torch.no_grad():
        proj.weight.copy_(torch.randn(heads * (nope + v_dim), rank) * max(nope, rank) ** -0.5)
    proj = proj.to(device=device, dtype=dtype)
    w = proj.per_head()
    assert w.w_uk.data_ptr() == w.kv_b.data_ptr() and w.w_uk.stride() == ((nope + v_dim) * rank, rank, 1)
    assert w.w_uv.stride() == w.w_uk.stride()
    assert w.w_uv.data_ptr() == w.kv_b.data_ptr() + nope * rank * w.kv_b.element_size()
    return w.w_uk.detach(), w.w_uv.detach()


def _check(out, ref, abs_sum, dtype):
    """out within 1e-5 of the products' absolute sum (float32), or within one ulp of the exact result rounded once
    (bf16)."""
    assert out.dtype == dtype and out.shape == ref.shape
    if dtype == torch.float32:
        assert torch.isfinite(out).all()
        err = ((out - ref).abs() / (abs_sum + 1e-30)).max().item()
        assert err < 1e-5, f"error {err:.2e} of the absolute sum"
    else:
        assert_within_ulps(out, ref.to(dtype), dtype, ulps=1, min_exact=MIN_EXACT,
                           atol=2.0 ** -20 * abs_sum.max().item())


def _query(bsz, heads, nope, rope, dtype, device):
    """q_nope [B, H, N] as the layer splits it off q [B, H, N + rope] (row strides of the whole q)."""
    q = torch.randn(bsz, heads, nope + rope, device=device).to(dtype)
    return q[..., :nope]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,nope,v_dim,rank", SHAPES)
@pytest.mark.parametrize("bsz", BATCHES)
@pytest.mark.parametrize("mma", KERNELS)
def test_absorb_query(device, dtype, bsz, heads, nope, v_dim, rank, mma):
    if mma:      # the tensor-core kernels' bf16 tl.dot (the GEMVs have none)
        skip_bf16_in_interpreter(dtype)
    w_uk, _ = _kv_b(heads, nope, v_dim, rank, dtype, device)
    q_nope = _query(bsz, heads, nope, 64, dtype, device)
    assert q_nope.stride() == (heads * (nope + 64), nope + 64, 1)
    out = absorb_query(q_nope, w_uk, mma=mma)
    assert out.shape == (bsz, heads, rank) and out.is_contiguous()
    ref = absorb_query_ref(q_nope.double(), w_uk.double())
    abs_sum = absorb_query_ref(q_nope.double().abs(), w_uk.double().abs())
    _check(out, ref, abs_sum, dtype)
    if dtype == torch.bfloat16:      # the bmm the kernel replaces, in bf16: same once-rounded result up to order
        assert_within_ulps(out, absorb_query_ref(q_nope, w_uk), dtype, ulps=2, min_exact=MIN_EXACT / 2,
                           atol=2.0 ** -20 * abs_sum.max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,nope,v_dim,rank", SHAPES)
@pytest.mark.parametrize("bsz", BATCHES)
@pytest.mark.parametrize("mma", KERNELS)
def test_expand_values(device, dtype, bsz, heads, nope, v_dim, rank, mma):
    """out_lat as the backend passes it (a [B, H, R] view of a heads-major [H, B, R] tensor), written into a given
    contiguous out."""
    if mma:      # the tensor-core kernels' bf16 tl.dot (the GEMVs have none)
        skip_bf16_in_interpreter(dtype)
    _, w_uv = _kv_b(heads, nope, v_dim, rank, dtype, device)
    out_lat = torch.randn(heads, bsz, rank, device=device).to(dtype).transpose(0, 1)
    out = torch.full((bsz, heads, v_dim), float("nan"), device=device, dtype=dtype)
    assert expand_values(out_lat, w_uv, out, mma=mma) is out
    ref = expand_values_ref(out_lat.double(), w_uv.double(), torch.empty(bsz, heads, v_dim, device=device).double())
    abs_sum = expand_values_ref(out_lat.double().abs(), w_uv.double().abs(), torch.empty_like(ref))
    _check(out, ref, abs_sum, dtype)
    if dtype == torch.bfloat16:
        bmm = expand_values_ref(out_lat, w_uv, torch.empty_like(out))
        assert_within_ulps(out, bmm, dtype, ulps=2, min_exact=MIN_EXACT / 2, atol=2.0 ** -20 * abs_sum.max().item())


@pytest.mark.parametrize("mma", KERNELS)
def test_expand_values_writes_only_its_view(device, mma):
    """out a strided view (a heads-major [H, B, V] buffer seen as [B, H, V], inside a wider row): every element of
    the view written, nothing around it."""
    bsz, heads, v_dim, rank = 3, 5, 24, 40
    w_uv = torch.randn(heads, v_dim, rank, device=device)
    out_lat = torch.randn(bsz, heads, rank, device=device)
    buf = torch.full((heads, bsz, v_dim + 8), float("nan"), device=device)
    out = buf[..., 4:4 + v_dim].transpose(0, 1)
    expand_values(out_lat, w_uv, out, mma=mma)
    ref = expand_values_ref(out_lat.double(), w_uv.double(), torch.empty(bsz, heads, v_dim, device=device).double())
    abs_sum = expand_values_ref(out_lat.double().abs(), w_uv.double().abs(), torch.empty_like(ref))
    _check(out, ref, abs_sum, torch.float32)
    assert buf[..., :4].isnan().all() and buf[..., 4 + v_dim:].isnan().all()


@pytest.mark.parametrize("mma", KERNELS)
def test_long_reductions(device, mma):
    """N beyond one absorb step (128 rows) and R beyond one expand step (512 columns), with odd sizes."""
    bsz, heads = 3, 2
    w_uk = torch.randn(heads, 200, 40, device=device) / 200 ** 0.5
    q_nope = torch.randn(bsz, heads, 200, device=device)
    q64, w64 = q_nope.double(), w_uk.double()
    _check(absorb_query(q_nope, w_uk, mma=mma), absorb_query_ref(q64, w64), absorb_query_ref(q64.abs(), w64.abs()),
           torch.float32)
    w_uv = torch.randn(heads, 9, 700, device=device) / 700 ** 0.5
    out_lat = torch.randn(bsz, heads, 700, device=device)
    out = expand_values(out_lat, w_uv, torch.empty(bsz, heads, 9, device=device), mma=mma)
    x64, w64, out64 = out_lat.double(), w_uv.double(), torch.empty_like(out, dtype=torch.float64)
    _check(out, expand_values_ref(x64, w64, out64.clone()), expand_values_ref(x64.abs(), w64.abs(), out64),
           torch.float32)


def test_empty_batch(device):
    w_uk = torch.randn(2, 8, 16, device=device)
    assert absorb_query(torch.randn(0, 2, 8, device=device), w_uk).shape == (0, 2, 16)
    out = torch.empty(0, 2, 8, device=device)
    assert expand_values(torch.randn(0, 2, 16, device=device), w_uk, out) is out


def test_absorb_supported():
    assert not absorb_supported(0)
    assert absorb_supported(1) and absorb_supported(MAX_ABSORB_BATCH) and absorb_supported(MAX_MMA_BATCH)
    assert not absorb_supported(MAX_MMA_BATCH + 1)
    assert not use_mma(1) and not use_mma(MAX_ABSORB_BATCH) and use_mma(MAX_ABSORB_BATCH + 1)
