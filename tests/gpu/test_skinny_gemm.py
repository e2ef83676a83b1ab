"""The skinny GEMM (2-32 rows; 33-64 under DEEPSERVE_SKINNY_64_ROWS) against F.linear in float32 on the same values
(exact products, another summation order: within one rounding of the output dtype), its SwiGLU epilogue against the
two-launch path, and the layers' dispatch to it."""

import pytest
import torch
from torch import nn

from deepserve.kernels.activation import silu_and_mul
from deepserve.kernels.skinny_gemm import (SHORT_K, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS_SHORT_K, SPLIT_K_MIN_K,
                                           WIDE_MAX_ROWS, WIDE_N,
                                           SkinnyTiles, skinny_linear, skinny_linear_two, skinny_max_rows,
                                           skinny_swiglu, skinny_tiles, split_counters)
from deepserve.layers import linear as linear_module
from deepserve.layers.linear import Linear, fused_swiglu_linear
from deepserve.layers.mlp import GatedMLP, swiglu_activation

from kernel_testing import DTYPES, assert_within_ulps, skip_bf16_in_interpreter


def _scale(x, w):
    return (x.float().abs() @ w.float().abs().t()).max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(2, 40, 64), (8, 100, 300), (16, 33, 1024), (5, 512, 520), (3, 7, 16),
                                   (32, 100, 300), (24, 64, 2048), (64, 100, 600), (48, 64, 2048)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_matches_linear(device, dtype, m, n, k, with_bias):
    """Up to 64 rows (past 32 for the weights `skinny_wide_tiles` names, at half the K step: `_launch`)."""
    skip_bf16_in_interpreter(dtype)
    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) * k ** -0.5).to(dtype)
    bias = torch.randn(n, device=device).to(dtype) if with_bias else None
    out = skinny_linear(x, w, bias)
    ref = torch.nn.functional.linear(x.float(), w.float(), None if bias is None else bias.float()).to(dtype)
    assert out.shape == (m, n) and out.dtype == dtype
    assert_within_ulps(out, ref, dtype, ulps=1, min_exact=0.9, atol=2.0 ** -20 * _scale(x, w))


@pytest.mark.parametrize("tiles", [SkinnyTiles(16, 128, 4, 3, 0), SkinnyTiles(32, 256, 8, 4, 1),
                                   SkinnyTiles(64, 512, 4, 2, 2), SkinnyTiles(16, 128, 4, 3, 1, split_k=3),
                                   SkinnyTiles(32, 64, 4, 4, 2, split_k=8), SkinnyTiles(16, 512, 4, 4, 1, split_k=4)])
def test_skinny_linear_tilings_agree(device, tiles):
    """Every tiling the tuning sweep tries computes the same product (K tails, row tails, strided rows of x)."""
    x = torch.randn(6, 2 * 700, device=device).half()[:, ::2]             # stride 2 along K
    w = (torch.randn(90, 700, device=device) * 700 ** -0.5).half()
    ref = torch.nn.functional.linear(x.float(), w.float()).half()
    assert_within_ulps(skinny_linear(x, w, tiles=tiles), ref, torch.float16, ulps=1, min_exact=0.9, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split_k", [2, 4])
def test_split_k_sums_the_parts_in_order(device, dtype, split_k):
    """A split-K launch: F.linear's product within one rounding, bit for bit the same over repeated launches
    (the last part to finish sums the partials in split order, whichever part that is), the tile counters back at
    zero after each launch, and its SwiGLU and two-weight modes as the unsplit launch's within one rounding."""
    skip_bf16_in_interpreter(dtype)
    m, n, k = 8, 200, 1024 + 64
    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) * k ** -0.5).to(dtype)
    tiles = SkinnyTiles(16, 128, 4, 4, 1, split_k=split_k)
    first = skinny_linear(x, w, tiles=tiles)
    ref = torch.nn.functional.linear(x.float(), w.float()).to(dtype)
    assert_within_ulps(first, ref, dtype, ulps=1, min_exact=0.9, atol=2.0 ** -20 * _scale(x, w))
    for _ in range(4):
        assert torch.equal(skinny_linear(x, w, tiles=tiles), first)
    assert not split_counters(torch.device(device)).any()
    w_b = (torch.randn(40, k, device=device) * k ** -0.5).to(dtype)
    y_a, y_b = skinny_linear_two(x, w, w_b, tiles=tiles)
    assert torch.equal(y_a, first)
    assert_within_ulps(y_b, torch.nn.functional.linear(x.float(), w_b.float()).to(dtype), dtype, ulps=1,
                       min_exact=0.9, atol=2.0 ** -20 * _scale(x, w_b))
    act = skinny_swiglu(x, w, tiles=tiles)
    assert_within_ulps(act, silu_and_mul(first), dtype, ulps=1, min_exact=0.95, atol=2.0 ** -14)
    assert not split_counters(torch.device(device)).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n_a,n_b,k", [(2, 40, 24, 64), (8, 3072, 576, 2048), (32, 100, 9, 300), (5, 16, 16, 520),
                                         (4, 40, 1, 64)])
def test_skinny_linear_two_is_two_products(device, dtype, m, n_a, n_b, k):
    """Two weights in one launch: each output is F.linear's within one rounding, and bit for bit what the one-weight
    launch computes with the same tiling (the programs of the second weight follow the first's)."""
    skip_bf16_in_interpreter(dtype)
    x = torch.randn(m, k, device=device).to(dtype)
    w_a = (torch.randn(n_a, k, device=device) * k ** -0.5).to(dtype)
    w_b = (torch.randn(n_b, k, device=device) * k ** -0.5).to(dtype)
    y_a, y_b = skinny_linear_two(x, w_a, w_b)
    tiles = skinny_tiles(n_a + n_b, k) if min(n_a, n_b) > 1 else None     # one-row weights: a launch each
    for y, w in ((y_a, w_a), (y_b, w_b)):
        assert y.shape == (m, w.shape[0]) and y.dtype == dtype
        ref = torch.nn.functional.linear(x.float(), w.float()).to(dtype)
        assert_within_ulps(y, ref, dtype, ulps=1, min_exact=0.9, atol=2.0 ** -20 * _scale(x, w))
        assert torch.equal(y, skinny_linear(x, w, tiles=tiles or skinny_tiles(*w.shape)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,inter,k", [(2, 5, 40), (8, 48, 1100), (16, 300, 64), (4, 1000, 512)])
@pytest.mark.parametrize("limit", [None, 0.5])
def test_skinny_swiglu_is_the_gemm_then_the_activation(device, dtype, m, inter, k, limit):
    """One launch = the GEMM, its output rounded to the dtype, then the SwiGLU as the unfused path computes it
    (the SiLU-and-mul kernel's arithmetic; with a limit, swiglu_activation's clamps)."""
    skip_bf16_in_interpreter(dtype)
    x = torch.randn(m, k, device=device).to(dtype)
    w13 = (torch.randn(2 * inter, k, device=device) * k ** -0.5).to(dtype)
    out = skinny_swiglu(x, w13, limit)
    assert out.shape == (m, inter) and out.dtype == dtype
    gate_up = skinny_linear(x, w13)
    if limit is None:     # the SwiGLU tile interleaves gate and up rows: equal up to the summation order
        assert_within_ulps(out, silu_and_mul(gate_up), dtype, ulps=1, min_exact=0.95, atol=2.0 ** -14)
    ref = swiglu_activation(torch.nn.functional.linear(x.float(), w13.float()).to(dtype), limit)
    assert_within_ulps(out, ref, dtype, ulps=2, min_exact=0.8, atol=2.0 ** -14)


def test_skinny_tiles():
    """The H200 sweep's picks (benchmarks/tune_skinny_gemm.json): 16 rows per program up to 2048 rows, 64 below
    4096, 32 rows with K steps of 512 for rows longer than 4096 and 4096 x 4096, else 64 rows with steps of 128
    (Llama-3-8B's gate/up, qkv, LM head); short rows get a K step of their own length; narrow weights of long rows
    (Llama-3.2-1B's down, Qwen3-MoE's o_proj) split K in 4 parts of 64-row tiles."""
    assert skinny_tiles(2048, 2048)[:4] == (16, 256, 4, 4)
    assert skinny_tiles(3072, 2048)[:2] == (64, 256)
    assert skinny_tiles(4096, 14336)[:2] == (32, 512) and skinny_tiles(4096, 4096)[:2] == (32, 512)
    assert skinny_tiles(16384, 2048)[:2] == (64, 128)
    assert skinny_tiles(28672, 4096)[:2] == (64, 128) and skinny_tiles(6144, 4096)[:2] == (64, 128)
    assert skinny_tiles(129280, 7168)[:2] == (32, 512)
    assert skinny_tiles(100, 40).block_k == 64
    assert skinny_tiles(2048, 8192) == skinny_tiles(2048, SPLIT_K_MIN_K) == SkinnyTiles(64, 256, 4, 4, 1, split_k=4)
    assert skinny_tiles(WIDE_N - 1, 14336).split_k == 4
    assert skinny_tiles(2048, SPLIT_K_MIN_K - 1).split_k == skinny_tiles(WIDE_N, 14336).split_k == 1


def test_linear_and_mlp_dispatch_few_rows(device, monkeypatch):
    """2-16 half-precision rows on the GPU go to the skinny GEMM (the MLP's gate/up with its SwiGLU, up to
    WIDE_MAX_ROWS); one row to the GEMV; more rows, float32 or autograd to F.linear. Results as the unfused path's,
    up to summation order."""
    monkeypatch.setattr(linear_module, "use_triton", lambda x: True)
    import deepserve.kernels.skinny_gemm as skinny_module
    calls = []
    real = skinny_module.skinny_linear
    monkeypatch.setattr(skinny_module, "skinny_linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    layer = Linear(40, 24, bias=True).to(device).half()
    ref_layer = nn.Linear(40, 24, bias=True).to(device).half()
    ref_layer.load_state_dict(layer.state_dict())
    with torch.inference_mode():
        x = torch.randn(8, 40, device=device).half()
        assert_within_ulps(layer(x), ref_layer(x), torch.float16, ulps=1, min_exact=0.9, atol=1e-4)
        layer(torch.randn(1, 40, device=device).half())                           # the GEMV
        layer(torch.randn(skinny_max_rows(24, 40) + 1, 40, device=device).half())    # cuBLAS
        layer.float()(torch.randn(4, 40, device=device))                          # float32
    assert calls == [8]
    mlp = GatedMLP(40, 24).to(device).half()
    x = torch.randn(4, 40, device=device).half()
    with torch.inference_mode():
        fused = fused_swiglu_linear(x, mlp.gate_up_proj, None)
        assert fused is not None and fused.shape == (4, 24)
        assert fused_swiglu_linear(torch.randn(WIDE_MAX_ROWS + 1, 40, device=device).half(),
                                   mlp.gate_up_proj, None) is None
        ref = swiglu_activation(torch.nn.functional.linear(x, mlp.gate_up_proj.weight), None)
    assert_within_ulps(fused, ref, torch.float16, ulps=2, min_exact=0.8, atol=1e-4)


def test_wide_rows_go_skinny_only_for_the_named_weights(device, monkeypatch):
    """DEEPSERVE_SKINNY_64_ROWS: 33-64 rows take the skinny GEMM for SwiGLU gate/up weights of rows up to SHORT_K long
    and for split-K weights only, at `skinny_wide_tiles`' tiles (the products as the unfused path's); off, or past
    64 rows, or for other weights, they stay on cuBLAS."""
    import deepserve.kernels.skinny_gemm as skinny_module
    monkeypatch.setattr(linear_module, "use_triton", lambda x: True)

    def applies(rows, weight_shape, swiglu=False):
        with torch.inference_mode():      # shapes only: meta tensors
            return skinny_module.skinny_applies(torch.empty(rows, weight_shape[1], device="meta", dtype=torch.bfloat16),
                                                torch.empty(weight_shape, device="meta", dtype=torch.bfloat16), swiglu)
    monkeypatch.setattr(skinny_module, "WIDE_ROWS", False)
    assert not applies(48, (16384, 2048), swiglu=True)
    monkeypatch.setattr(skinny_module, "WIDE_ROWS", True)
    assert applies(48, (16384, 2048), swiglu=True) and applies(33, (2048, 8192)) and applies(64, (2048, 8192))
    assert not applies(65, (2048, 8192)) and not applies(48, (16384, 2048)) and not applies(48, (3072, 2048))
    assert skinny_module.skinny_wide_tiles(2048, 8192, False) == SkinnyTiles(64, 256, 4, 4, 1, split_k=4)
    assert skinny_module.skinny_wide_tiles(16384, 2048, True) == SkinnyTiles(128, 256, 8, 3)
    assert skinny_module.skinny_wide_tiles(16384, 2048, False) is None
    assert skinny_module.skinny_wide_tiles(28672, 4096, True) is None

    launched = []
    real_launch = skinny_module._launch
    monkeypatch.setattr(skinny_module, "_launch", lambda *a, **kw: launched.append(a[5]) or real_launch(*a, **kw))
    mlp = GatedMLP(64, 48).to(device).half()
    x = torch.randn(40, 64, device=device).half()
    with torch.inference_mode():
        fused = fused_swiglu_linear(x, mlp.gate_up_proj, None)
        ref = swiglu_activation(torch.nn.functional.linear(x, mlp.gate_up_proj.weight), None)
        assert fused_swiglu_linear(torch.randn(65, 64, device=device).half(), mlp.gate_up_proj, None) is None
        plain = Linear(64, 24).to(device).half()(x)                        # not a named weight: cuBLAS
    assert fused is not None and plain.shape == (40, 24)
    assert launched == [SkinnyTiles(128, 256, 8, 3)]
    assert_within_ulps(fused, ref, torch.float16, ulps=2, min_exact=0.8, atol=1e-4)


def test_max_rows_follow_the_weight_shape():
    """32 rows for weight rows up to SHORT_K long, weights of at least WIDE_N rows and the split-K weights (rows of
    at least SPLIT_K_MIN_K), 16 for narrow weights of rows between (the measured rule)."""
    assert skinny_max_rows(24, 64) == skinny_max_rows(2048, SHORT_K) == SKINNY_MAX_ROWS_SHORT_K == 32
    assert skinny_max_rows(WIDE_N, 4096) == skinny_max_rows(28672, 4096) == skinny_max_rows(4096, 14336) == 32
    assert skinny_max_rows(WIDE_N - 1, SPLIT_K_MIN_K) == skinny_max_rows(2048, 8192) == 32
    assert skinny_max_rows(2048, SHORT_K + 1) == skinny_max_rows(WIDE_N - 1, SPLIT_K_MIN_K - 1) == SKINNY_MAX_ROWS == 16


def test_skinny_switch_off_keeps_cublas(device, monkeypatch):
    monkeypatch.setattr(linear_module, "use_triton", lambda x: True)
    monkeypatch.setattr(linear_module, "_SKINNY", False)
    mlp = GatedMLP(40, 24).to(device).half()
    with torch.inference_mode():
        assert fused_swiglu_linear(torch.randn(4, 40, device=device).half(), mlp.gate_up_proj, None) is None


def test_few_rows_through_a_cpu_engine_in_the_interpreter(tiny_llama, monkeypatch):
    """The engine's small-batch decode GEMMs end to end on the CPU through Triton's interpreter (fp16: the
    interpreter's bf16 products are wrong): decode steps of 4 rows run every layer's projections in the skinny
    GEMM (qkv, o_proj, gate/up with the SwiGLU, down), and the greedy tokens are the plain CPU engine's up to a near
    tie."""
    from deepserve import LLM, SamplingParams
    from deepserve.kernels import INTERPRET
    import deepserve.kernels.skinny_gemm as skinny_module
    from tests.engine.near_tie import first_divergence_is_a_near_tie
    if not INTERPRET:
        pytest.skip("the interpreter's run of the CPU engine (the GPU engine's tests run these GEMMs in bf16)")
    prompts = [{"prompt_token_ids": list(range(5 + i, 20 + 3 * i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)

    def run():
        llm = LLM(tiny_llama, skip_tokenizer_init=True, device="cpu", dtype="float16", max_model_len=128)
        return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    want = run()
    launched = []
    real_launch = skinny_module._launch
    monkeypatch.setattr(skinny_module, "_launch", lambda *a, **kw: launched.append(
        (a[0].shape[0], kw["swiglu"])) or real_launch(*a, **kw))
    monkeypatch.setattr(linear_module, "use_triton", lambda x: True)
    got = [o.token_ids for o in run()]
    four_rows = [swiglu for rows, swiglu in launched if rows == 4]
    layers = 2                  # tiny_llama's (tests/conftest.py)
    assert sum(four_rows) >= layers and len(four_rows) >= 4 * layers   # a 4-row step: 4 launches a layer
    parted = [i for i, (w, g) in enumerate(zip(want, got)) if w.token_ids != g]
    assert all(first_divergence_is_a_near_tie(want[i].token_ids, got[i], want[i].logprobs) for i in parted)
    assert len(parted) <= 1, parted
