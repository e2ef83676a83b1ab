"""mHC kernels against their twins (deepserve/kernels/reference/hyper_connection.py): the mixing weights (GEMV +
Sinkhorn), the read of a sublayer's input from the streams and the write of its output back."""

import pytest
import torch

from deepserve.kernels import INTERPRET
from deepserve.kernels.hyper_connection import (HC_BLOCK_T, HC_CHUNK_K, combine_streams, hc_mix, hc_mix_supported,
                                                streams_supported, write_back)
from deepserve.kernels.reference import hyper_connection as twin
from kernel_testing import assert_within_ulps
from test_fused_moe import _interpreter_scalars  # noqa: F401  (autouse fixture)

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NORM_EPS, HC_EPS, ITERS, POST_MULT = 1e-6, 1e-6, 20, 2.0
# pre, post, C against the float32 twin: float32 products in another order (tf32x3 on CUDA) over up to 20480 terms,
# through sigmoid and 20 Sinkhorn iterations (outputs in [0, 2]).
MIX_TOL = dict(rtol=1e-5, atol=2e-5)

# (tokens, streams, hidden): one K chunk (the single-launch path), several (K not a multiple of the chunk), two
# token tiles, streams that are not a power of two and a single stream; then the real m = 4, H = 5120.
SHAPES = [(1, 4, 64), (5, 4, 128), (3, 4, 300), (HC_BLOCK_T + 1, 4, 200), (2, 3, 50), (4, 1, 40), (3, 2, 700)]
REAL_TOKENS = [2] if INTERPRET else [1, 33, 256]


def _params(m, H, device, init=False):
    """fn, base, scale of one sublayer: random with mixes of order 1 (fn ~ 1/sqrt(mH), scale ~ 1), or the container
    init of §2.4 (fn = 0, scale 0.01, base -3 / 0 / 3 on C's diagonal)."""
    n = m * (m + 2)
    if init:
        C0 = torch.full((m, m), -3.0)
        C0.fill_diagonal_(3.0)
        base = torch.cat((torch.full((m,), -3.0), torch.zeros(m), C0.flatten()))
        base[0] = 3.0
        return torch.zeros(n, m * H, device=device), base.to(device), torch.full((3,), 0.01, device=device)
    fn = torch.randn(n, m * H, device=device) / (m * H) ** 0.5
    return fn, torch.randn(n, device=device), (torch.rand(3, device=device) + 0.5)


def _check_mix(R, fn, base, scale):
    assert hc_mix_supported(R, fn, base, scale)
    out = hc_mix(R, fn, base, scale, NORM_EPS, HC_EPS, ITERS, POST_MULT)
    ref = twin.hc_mix(R, fn, base, scale, NORM_EPS, HC_EPS, ITERS, POST_MULT)
    for name, o, r in zip(("pre", "post", "C"), out, ref):
        assert o.dtype == torch.float32 and o.shape == r.shape, name
        torch.testing.assert_close(o, r, **MIX_TOL, msg=lambda m, name=name: f"{name}: {m}")
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-m{}-H{}".format(*s))
def test_hc_mix_matches_twin(device, dtype, shape):
    T, m, H = shape
    R = torch.randn(T, m, H, device=device).to(dtype)
    _check_mix(R, *_params(m, H, device))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", REAL_TOKENS)
def test_hc_mix_real_width(device, dtype, T):
    """m = 4, H = 5120: a 24 x 20480 matrix in 40 chunks, from one token to a 256-token decode batch; and the
    container init (fn = 0: the mix is the base)."""
    R = torch.randn(T, 4, 5120, device=device).to(dtype)
    _check_mix(R, *_params(4, 5120, device))
    pre, post, C = _check_mix(R, *_params(4, 5120, device, init=True))
    torch.testing.assert_close(C.sum(1), torch.ones(T, 4, device=device), rtol=0, atol=1e-4)  # columns sum to 1


def test_hc_mix_is_batch_independent(device):
    """A token's pre/post/C are the same bits alone and anywhere in a batch (tilings fixed, never a function of T),
    on the chunked and the single-launch paths."""
    for m, H in ((4, 5120 if not INTERPRET else 640), (4, 64)):
        params = _params(m, H, device)
        R = torch.randn(37, m, H, device=device)
        batched = hc_mix(R, *params, NORM_EPS, HC_EPS, ITERS, POST_MULT)
        for t in (0, 20, 36):
            alone = hc_mix(R[t:t + 1].clone(), *params, NORM_EPS, HC_EPS, ITERS, POST_MULT)
            for a, b in zip(alone, batched):
                assert torch.equal(a[0], b[t])


def test_hc_mix_strided_tokens(device):
    """R as rows of a larger trunk (token stride past m*H, each token's [m, H] contiguous): read in place; a
    transposed R (streams not contiguous) is copied first. Both equal the twin."""
    m, H = 4, 160
    params = _params(m, H, device)
    _check_mix(torch.randn(6, m * H + 32, device=device)[:, :m * H].view(6, m, H), *params)
    _check_mix(torch.randn(6, H, m, device=device).transpose(1, 2), *params)
    assert HC_CHUNK_K < m * H                                       # several chunks


def test_hc_mix_fallback(device):
    """More than 8 streams, or fn of the wrong width: the twin's result."""
    m, H = 9, 16
    R = torch.randn(2, m, H, device=device)
    params = _params(m, H, device)
    assert not hc_mix_supported(R, *params)
    for a, b in zip(hc_mix(R, *params, NORM_EPS, HC_EPS, ITERS, POST_MULT),
                    twin.hc_mix(R, *params, NORM_EPS, HC_EPS, ITERS, POST_MULT)):
        torch.testing.assert_close(a, b)
    fn, base, scale = _params(4, 16, device)
    assert not hc_mix_supported(torch.randn(2, 4, 8, device=device), fn, base, scale)


def test_hc_mix_empty(device):
    fn, base, scale = _params(4, 64, device)
    pre, post, C = hc_mix(torch.randn(0, 4, 64, device=device), fn, base, scale, NORM_EPS, HC_EPS, ITERS, POST_MULT)
    assert pre.shape == (0, 4) and post.shape == (0, 4) and C.shape == (0, 4, 4)


# --- combine_streams / write_back --------------------------------------------------------------------------------

STREAM_SHAPES = [(1, 4, 64), (7, 4, 1000), (3, 4, 5120), (5, 3, 100), (2, 1, 33), (4, 8, 2100)]


def _assert_stream_close(out, ref, dtype, magnitude):
    """float32 accumulation in another order, one rounding: half outputs within one rounding of the twin's and
    nearly all bit-identical (the interpreter truncates float32 -> bfloat16 instead of rounding: one ulp, any
    share); float32 outputs within a few ulps, plus reassociation error on sums that cancel (`magnitude`: the sum
    of the terms' absolute values)."""
    if dtype == torch.float32:
        assert_within_ulps(out, ref, dtype, ulps=2, min_exact=0.0, atol=2.0 ** -21 * magnitude)
    else:
        truncating = INTERPRET and dtype == torch.bfloat16
        assert_within_ulps(out, ref, dtype, ulps=1, min_exact=0.0 if truncating else 0.98,
                           atol=2.0 ** -21 * magnitude)


def _stream_operands(device, dtype, T, m, H):
    R = torch.randn(T, m, H + 24, device=device).to(dtype)[..., :H]       # stream stride past H: read in place
    post = 2 * torch.rand(T, m, device=device)
    C = torch.rand(T, m, m, device=device)
    C = C / C.sum(1, keepdim=True)
    return R, post, C


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", STREAM_SHAPES, ids=lambda s: "T{}-m{}-H{}".format(*s))
def test_combine_streams_matches_twin(device, dtype, shape):
    R, pre, _ = _stream_operands(device, dtype, *shape)
    assert streams_supported(R, pre)
    out = combine_streams(R, pre)
    ref = twin.combine_streams(R, pre)
    assert out.dtype == dtype and out.shape == ref.shape
    magnitude = torch.einsum("tm,tmh->th", pre.abs(), R.float().abs()).max().item()
    _assert_stream_close(out, ref, dtype, magnitude)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", STREAM_SHAPES, ids=lambda s: "T{}-m{}-H{}".format(*s))
def test_write_back_matches_twin(device, dtype, shape):
    T, m, H = shape
    R, post, C = _stream_operands(device, dtype, T, m, H)
    y = torch.randn(T, H, device=device).to(dtype)
    assert streams_supported(R, y, post, C)
    out = write_back(R, y, post, C)
    ref = twin.write_back(R, y, post, C)
    assert out.dtype == dtype and out.shape == ref.shape
    magnitude = (torch.einsum("tij,tih->tjh", C, R.float().abs()) + post[..., None] * y.float().abs()[:, None]).max()
    _assert_stream_close(out, ref, dtype, magnitude.item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_back_in_place_and_strided(device, dtype):
    """out = R (each program reads its whole tile of every stream before it writes); C transposed, y and post as
    column slices: the same bits as a fresh output."""
    T, m, H = 5, 4, 700
    R = torch.randn(T, m, H, device=device).to(dtype)
    y = torch.randn(T, 2 * H, device=device).to(dtype)[:, :H]
    post = (2 * torch.rand(T, 2 * m, device=device))[:, ::2]
    C = torch.rand(T, m, m, device=device).transpose(1, 2)
    fresh = write_back(R, y, post, C)
    _assert_stream_close(fresh, twin.write_back(R, y, post, C), dtype, 8.0 * R.float().abs().max().item())
    same = write_back(R, y, post, C, out=R)
    assert same.data_ptr() == R.data_ptr() and torch.equal(R, fresh)


def test_streams_fallback_and_empty(device):
    R = torch.randn(2, 9, 16, device=device)                          # m > 8: the twin
    w = torch.rand(2, 9, device=device)
    assert not streams_supported(R, w)
    torch.testing.assert_close(combine_streams(R, w), twin.combine_streams(R, w))
    R = torch.randn(0, 4, 16, device=device)
    assert combine_streams(R, torch.rand(0, 4, device=device)).shape == (0, 16)
    assert write_back(R, torch.randn(0, 16, device=device), torch.rand(0, 4, device=device),
                      torch.rand(0, 4, 4, device=device)).shape == (0, 4, 16)
