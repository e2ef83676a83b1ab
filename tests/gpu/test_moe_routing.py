"""Fused MoE routing kernel (scores, bias, group filter, top-k, weights, load count in one launch) against its
PyTorch twin, route() + index_add_: ids identical, weights within 1e-6 relative, load counters equal."""

import pytest
import torch

from deepserve.kernels import INTERPRET
from deepserve.kernels import moe_routing as routing
from deepserve.kernels.moe_routing import (MMA_SPLIT_TILES, MMA_TILES, ROUTER_GEMV_MAX_TOKENS,
                                           ROUTER_MMA_MAX_TOKENS, ROUTER_TILED_MAX_TOKENS, fused_route,
                                           fused_route_ref,
                                           fused_route_supported, router_logit_partials,
                                           router_logit_partials_supported, router_logits, router_logits_supported,
                                           router_splits, router_tiles, sum_partials)
from deepserve.layers import moe as moe_module
from deepserve.layers.moe import FusedMoE, RoutingConfig

from kernel_testing import assert_within_ulps

pytestmark = pytest.mark.gpu

SCORINGS = ["softmax", "sigmoid", "sqrtsoftplus"]
TOKENS = [1, 3, 64]
# (E, k): every E and every k of the target models at least once, odd sizes (60) that need masks.
GREEDY_SHAPES = [(8, 1), (8, 2), (60, 6), (64, 8), (128, 2), (256, 8)]
# (E, groups, topk_groups, k): V3-like last; 60 = 4 groups of 15 (masked group rows), k = 1 with groups.
GROUP_SHAPES = [(8, 4, 2, 2), (60, 4, 2, 6), (64, 8, 3, 6), (128, 8, 4, 1), (256, 8, 4, 8)]
SQRT_TIE = (21.0, 21.000001907348633)   # adjacent floats whose square roots round to one float32


def _logits(t, e, device, seed=0):
    """[t, e] float32 logits with ties on purpose, row r of kind (r + 1) % 4 (so T = 1 and 3 have ties too):
    0 continuous; 1 few distinct values (ties everywhere, between group scores too); 2 the three largest
    duplicated at random places; 3 large logits that round to equal scores: sigmoid saturates to 1.0, and above
    softplus's threshold sqrt merges 21 and the next float (the larger one at the higher id, so picking by logit
    instead of by score would show)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, e, generator=gen) * 2
    for r in range(t):
        kind = (r + 1) % 4
        if kind == 1:
            x[r] = torch.randint(-2, 3, (e,), generator=gen) / 2
        elif kind == 2:
            places = torch.randperm(e, generator=gen)[:6]
            x[r, places] = x[r].topk(3).values.repeat(2)[:len(places)]
        elif kind == 3:
            places = torch.randperm(e, generator=gen)[:5].sort().values
            x[r, places] = torch.tensor([*SQRT_TIE, 19.0, 18.0, 17.5])[:len(places)]
    return x.to(device)


def _bias(e, device, seed=1):
    """Correction bias in steps of 0.25: equal logits with equal bias still tie."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(-2, 3, (e,), generator=gen) * 0.25).to(device)


def _check(cfg, logits, bias=None):
    load = torch.zeros(logits.shape[1], dtype=torch.int64, device=logits.device)
    load_ref = load.clone()
    weights, ids = fused_route(logits, cfg, bias, load)
    ref_w, ref_ids = fused_route_ref(logits, cfg, bias, load_ref)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32 and ids.shape == ref_ids.shape
    mismatch = (ids != ref_ids).any(dim=1).nonzero().flatten().tolist()
    assert not mismatch, f"rows {mismatch}: {ids[mismatch].tolist()} != {ref_ids[mismatch].tolist()}"
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=0.0)
    assert torch.equal(load, load_ref)


def test_sqrt_tie_is_a_tie():
    """The constructed sqrtsoftplus tie holds in float32 (else the ties test above tests nothing)."""
    a, b = torch.tensor(SQRT_TIE)
    assert a < b and a.sqrt() == b.sqrt()
    assert torch.equal(torch.tensor([17.5, 18.0, 21.0]).sigmoid(), torch.ones(3))


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("shape", GREEDY_SHAPES, ids=lambda s: "E{}-k{}".format(*s))
@pytest.mark.parametrize("scoring", SCORINGS)
def test_greedy_matches_route(device, scoring, shape, t):
    e, k = shape
    cfg = RoutingConfig(top_k=k, scoring=scoring, renormalize=k > 1, scaling_factor=1.0 if k == 2 else 2.5)
    _check(cfg, _logits(t, e, device))


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("shape", GROUP_SHAPES, ids=lambda s: "E{}-G{}-g{}-k{}".format(*s))
@pytest.mark.parametrize("method", ["group_limited_greedy", "noaux_tc"])
@pytest.mark.parametrize("scoring", SCORINGS)
def test_grouped_matches_route(device, scoring, method, shape, t):
    """Group filter: V2's best-expert group score and V3's top-two sum (with the bias for noaux_tc)."""
    e, groups, topk_groups, k = shape
    cfg = RoutingConfig(top_k=k, scoring=scoring, topk_method=method, num_groups=groups, topk_groups=topk_groups,
                        renormalize=method == "noaux_tc", scaling_factor=16.0)
    _check(cfg, _logits(t, e, device), _bias(e, device) if method == "noaux_tc" else None)


MODELS = {   # name: (E, routing), as the model configs set them
    "mixtral": (8, RoutingConfig(top_k=2, renormalize=True)),
    "qwen3_moe": (128, RoutingConfig(top_k=8, renormalize=True)),
    "deepseek_v2_lite": (64, RoutingConfig(top_k=6, topk_method="group_limited_greedy", num_groups=1)),
    "deepseek_v2": (160, RoutingConfig(top_k=6, topk_method="group_limited_greedy", num_groups=8, topk_groups=3,
                                       scaling_factor=16.0)),
    "deepseek_v3": (256, RoutingConfig(top_k=8, scoring="sigmoid", topk_method="noaux_tc", num_groups=8,
                                       topk_groups=4, renormalize=True, scaling_factor=2.5)),
    "deepseek_v4_1": (256, RoutingConfig(top_k=8, scoring="sqrtsoftplus", topk_method="noaux_tc", renormalize=True,
                                         scaling_factor=1.5)),
}


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_configs_match_route(device, name, t):
    e, cfg = MODELS[name]
    bias = _bias(e, device) if cfg.uses_bias else None
    _check(cfg, _logits(t, e, device, seed=t), bias)


def test_group_ties(device):
    """Group scores tie on purpose: every group alike (the lowest group ids stay), and V3 groups whose best expert
    appears twice (the duplicate counts in the top-two sum)."""
    e, groups = 32, 4
    logits = torch.zeros(4, e)
    logits[1] = torch.arange(8.0).repeat(4)                   # four identical groups
    logits[2, [9, 10]] = 3.0                                  # group 1: 3 + 3 ...
    logits[2, [17, 25]] = torch.tensor([4.0, 1.9])            # ... beats group 2 (4 + 0) under V3 with sigmoid
    logits[3, [8, 30]] = 2.0                                  # groups 1 and 3 tie: group 1 first
    for method in ("group_limited_greedy", "noaux_tc"):
        for scoring in SCORINGS:
            cfg = RoutingConfig(top_k=3, scoring=scoring, topk_method=method, num_groups=groups, topk_groups=2)
            _check(cfg, logits.to(device))


@pytest.mark.parametrize("scoring", SCORINGS)
def test_nan_logits_greedy(device, scoring):
    """A NaN counts as the largest score, as in torch.sort (softmax: the whole row is NaN, ids 0..k-1): the ids
    stay real experts and equal route()'s."""
    logits = _logits(3, 8, device)
    logits[0, 5] = logits[1, 2] = logits[1, 6] = float("nan")
    cfg = RoutingConfig(top_k=3, scoring=scoring)
    weights, ids = fused_route(logits, cfg)
    ref_w, ref_ids = fused_route_ref(logits, cfg)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=0.0, equal_nan=True)


def test_load_counter_accumulates(device):
    """Several calls into one counter (as decode steps do until the engine resets it) = torch's bincount."""
    e, cfg = MODELS["deepseek_v3"]
    bias = _bias(e, device)
    load = torch.zeros(e, dtype=torch.int64, device=device)
    all_ids = []
    for step, t in enumerate([3, 1, 17, 1]):
        _, ids = fused_route(_logits(t, e, device, seed=step), cfg, bias, load)
        all_ids.append(ids.flatten())
    assert torch.equal(load, torch.bincount(torch.cat(all_ids), minlength=e))
    assert int(load.sum()) == 22 * cfg.top_k


def test_strided_logits_and_half_bias(device):
    """Logits as a column slice of a wider tensor; a bias the model cast to bf16 (added as float32, as torch
    promotes it); no load counter."""
    e, cfg = MODELS["deepseek_v3"]
    wide = _logits(5, e + 16, device)
    bias = _bias(e, device).to(torch.bfloat16)
    weights, ids = fused_route(wide[:, 8:8 + e], cfg, bias)
    ref_w, ref_ids = fused_route_ref(wide[:, 8:8 + e], cfg, bias)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=0.0)


def test_empty_batch(device):
    cfg = RoutingConfig(top_k=2)
    load = torch.zeros(8, dtype=torch.int64, device=device)
    weights, ids = fused_route(torch.zeros(0, 8, device=device), cfg, None, load)
    assert weights.shape == ids.shape == (0, 2) and int(load.sum()) == 0


def test_supported_configs():
    """What the kernel refuses (the layer keeps route() there)."""
    assert fused_route_supported(MODELS["deepseek_v3"][1], 256)
    assert not fused_route_supported(RoutingConfig(top_k=8), 2048)                    # beyond registers
    assert not fused_route_supported(RoutingConfig(top_k=4), 2)                       # route() shape differs
    assert not fused_route_supported(RoutingConfig(top_k=2, topk_method="noaux_tc", num_groups=8), 8)  # topk(2) of 1


def test_layer_runs_the_kernel(device, monkeypatch):
    """FusedMoE on the kernel path (forced under the interpreter) = the same layer on route() + index_add_:
    same output, same load counter, and the kernel ran once per forward."""
    e, cfg = MODELS["deepseek_v3"]
    layer = FusedMoE(32, 16, e, cfg, shared_intermediate_size=16, gate_dtype=torch.float32).to(device)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.2)
    x = torch.randn(6, 32, device=device)
    with torch.inference_mode():
        monkeypatch.setattr(moe_module, "use_triton", lambda _: False)
        ref = layer(x)
        ref_load = layer.expert_load.clone()
        layer.reset_expert_load()
        calls = []

        def spy(*args, **kwargs):
            calls.append(1)
            return fused_route(*args, **kwargs)
        monkeypatch.setattr(moe_module, "use_triton", lambda _: True)
        monkeypatch.setattr(routing, "fused_route", spy)
        out = layer(x)
    assert len(calls) == 1
    assert torch.equal(layer.expert_load, ref_load)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
def test_cuda_graph(device):
    """Captured once (fixed shapes, no host sync), replayed on new logits written into the captured tensor: ids and
    weights equal route()'s each time, and the load counter keeps counting on every replay."""
    e, cfg = MODELS["deepseek_v3"]
    bias = _bias(e, device)
    logits = _logits(8, e, device)
    load = torch.zeros(e, dtype=torch.int64, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fused_route(logits, cfg, bias, load)                 # compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    load.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = fused_route(logits, cfg, bias, load)
    expected = torch.zeros_like(load)
    for seed in range(3):
        logits.copy_(_logits(8, e, device, seed=10 + seed))
        graph.replay()
        torch.cuda.synchronize()
        ref_w, ref_ids = fused_route_ref(logits, cfg, bias, expected)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=0.0)
    assert torch.equal(load, expected)


@pytest.mark.parametrize("t", [1, 3, 16])
@pytest.mark.parametrize("e,h", [(8, 40), (60, 2048), (64, 2048), (256, 700)])
@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                             (torch.bfloat16, torch.bfloat16)])
def test_router_logits_match_the_gate_gemm(device, t, e, h, x_dtype, w_dtype):
    """The decode-size gate GEMV = the gate GEMM in the gate's dtype. A float32 gate: F.linear in float32 on the
    same values (exact products; only the summation order differs: within 1e-5 of the row's magnitude). A bf16
    gate: every logit a bf16 value (rounded once, as cuBLAS's bf16 GEMM and HF round it), within one bf16 ulp of
    the exact product rounded, and of torch's own bf16 F.linear with full-precision reduction. (With torch's
    default, allow_bf16_reduced_precision_reduction, cuBLAS may sum split-K partials in bf16: on an H200, 31 of
    180 logits of a 60-expert gate at 3 tokens were beyond one ulp of the exact product, up to 7% off.)"""
    if INTERPRET and torch.bfloat16 in (x_dtype, w_dtype) and e * h > 64 * 2048:
        pytest.skip("bf16 loads are slow in the interpreter")
    x = torch.randn(t, h, device=device).to(x_dtype)
    w = (torch.randn(e, h, device=device) * 0.05).to(w_dtype)
    out = router_logits(x, w)
    assert out.dtype == torch.float32 and out.shape == (t, e)
    scale = (x.float().abs() @ w.float().abs().t()).max().item()
    if w_dtype == torch.float32:
        ref = torch.nn.functional.linear(x.float(), w.float())
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5 * scale)
        return
    assert torch.equal(out, out.to(w_dtype).float())                    # rounded to the gate's dtype
    exact = torch.nn.functional.linear(x.to(w_dtype).double(), w.double())
    # The interpreter truncates float32 -> bf16 instead of rounding: fewer bit-identical elements there.
    min_exact = 0.3 if INTERPRET else 0.9
    assert_within_ulps(out.to(w_dtype), exact.to(w_dtype), w_dtype, ulps=1, min_exact=min_exact,
                       atol=2.0 ** -20 * scale)
    reduced = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    try:
        cublas = torch.nn.functional.linear(x.to(w_dtype), w)
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
    assert_within_ulps(out.to(w_dtype), cublas, w_dtype, ulps=1, min_exact=min_exact / 2, atol=2.0 ** -20 * scale)


def test_router_logits_only_at_decode_sizes():
    assert router_logits_supported(torch.zeros(1, 8)) and router_logits_supported(torch.zeros(ROUTER_GEMV_MAX_TOKENS, 8))
    assert not router_logits_supported(torch.zeros(ROUTER_GEMV_MAX_TOKENS + 1, 8))
    assert not router_logits_supported(torch.zeros(0, 8))


H200_SMS = 132


@pytest.fixture
def h200_splits(monkeypatch):
    """The split counts of an H200 (132 SMs), whatever runs the test (the interpreter's num_sms is 8)."""
    monkeypatch.setattr(routing, "num_sms", lambda device: H200_SMS)


# The tensor-core variants (bf16 x on a float32 or bf16 gate): Triton 3.x's interpreter gets bf16 tl.dot wrong (off
# by orders of magnitude on random 16 x 16 tiles), so they run on a GPU only.
INTERPRETER_BF16_DOT = "bf16 tl.dot is wrong in the Triton interpreter"
GATE_DTYPES = [(torch.bfloat16, torch.float32), (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("t", [17, 64, 200, 512])
@pytest.mark.parametrize("e,h", [(64, 2048), (128, 2048), (8, 40), (60, 700)])
@pytest.mark.parametrize("x_dtype,w_dtype", GATE_DTYPES)
def test_router_logit_partials_match_the_gate_gemm(device, h200_splits, t, e, h, x_dtype, w_dtype):
    """The split-K gate GEMM, its partials summed in order = F.linear in float32 on the same values (exact
    products, another summation order: within 1e-5 of the row's magnitude). Odd T, E, H: masked tiles, splits of
    unequal length."""
    if INTERPRET and t * e * h > 17 * 128 * 2048:
        pytest.skip("the interpreter takes ~1 ms a K step of a tile: the larger shapes run on a GPU")
    if INTERPRET and x_dtype == torch.bfloat16:       # the tensor-core variants
        pytest.skip(INTERPRETER_BF16_DOT)
    x = torch.randn(t, h, device=device).to(x_dtype)
    w = (torch.randn(e, h, device=device) * 0.05).to(w_dtype)
    partials = router_logit_partials(x, w)
    splits = router_splits(t, e, h, x.device, router_tiles(x, w))
    assert partials.dtype == torch.float32 and partials.shape == (splits, t, e)
    ref = torch.nn.functional.linear(x.float(), w.float())
    scale = (x.float().abs() @ w.float().abs().t()).max().item()
    torch.testing.assert_close(sum_partials(partials), ref, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("t", [17, 300])
def test_router_mma_split_keeps_every_weight_bit(device, h200_splits, t):
    """The tensor-core variant (bf16 x, float32 gate) splits each weight into three bf16 parts: with one non-zero
    x per row, a power of two, every logit is x times one weight, exact in float32. The three parts' products add
    up to it exactly; the tensor cores' accumulation may round a partial sum, so the test asks for one float32
    rounding at most and most logits bit for bit. Weights with all 24 significand bits set at random: two parts (16
    bits) would be off by up to 2^-17 relative, one part by 2^-9."""
    if INTERPRET:
        pytest.skip(INTERPRETER_BF16_DOT)
    e, h = 64, 2048
    assert router_tiles(torch.zeros(1, 1, dtype=torch.bfloat16), torch.zeros(1, 1)) == MMA_SPLIT_TILES
    gen = torch.Generator().manual_seed(t)
    w = (torch.rand(e, h, generator=gen) + 0.5) * torch.randint(-3, 4, (e, h), generator=gen).float().exp2()
    x = torch.zeros(t, h)
    col = torch.randint(0, h, (t,), generator=gen)
    x[torch.arange(t), col] = torch.randint(-4, 5, (t,), generator=gen).float().exp2()
    x, w = x.to(torch.bfloat16).to(device), w.to(device)
    logits = sum_partials(router_logit_partials(x, w))
    expected = torch.stack([x[r, col[r]].float() * w[:, col[r]] for r in range(t)])       # [t, e]
    assert_within_ulps(logits, expected, torch.float32, ulps=1, min_exact=0.9)


@pytest.mark.parametrize("x_dtype,splits", [(torch.float32, 16), (torch.bfloat16, 8)])
def test_router_logit_partials_are_deterministic(device, h200_splits, x_dtype, splits):
    """No atomics: two calls give the same bits (16 splits of 22 K steps on CUDA cores, 8 of 11 on tensor cores)."""
    if INTERPRET and x_dtype == torch.bfloat16:
        pytest.skip(INTERPRETER_BF16_DOT)
    x = torch.randn(40, 700, device=device).to(x_dtype)
    w = torch.randn(60, 700, device=device) * 0.05
    first = router_logit_partials(x, w)
    assert first.shape[0] == splits
    assert torch.equal(first, router_logit_partials(x, w))


@pytest.mark.parametrize("round_to", [None, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("splits", [1, 3, 16])
@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3", "qwen3_moe"])
def test_route_sums_the_partials(device, name, splits, round_to):
    """fused_route on [S, T, E] partials = fused_route on their `sum_partials` bit for bit (the kernel sums them in
    the same order, and with `round_to` rounds the sum to a half-precision gate's dtype as sum_partials does), load
    counter included; and = route() on that sum as the [T, E] tests check (ids and load equal; weights within 1e-6:
    softmax's sum order, the interpreter's exp)."""
    if INTERPRET and round_to is not None:
        pytest.skip("the interpreter truncates float32 -> bf16 / fp16 where torch and the GPU round to nearest")
    e, cfg = MODELS[name]
    gen = torch.Generator().manual_seed(splits)
    partials = (torch.randn(splits, 8, e, generator=gen) * 2 / splits ** 0.5).to(device)
    bias = _bias(e, device) if cfg.uses_bias else None
    load, load_summed, load_ref = (torch.zeros(e, dtype=torch.int64, device=device) for _ in range(3))
    weights, ids = fused_route(partials, cfg, bias, load, round_to=round_to)
    logits = sum_partials(partials, round_to)
    if round_to is not None:
        assert torch.equal(logits, logits.to(round_to).float()) and not torch.equal(logits, sum_partials(partials))
    weights_summed, ids_summed = fused_route(logits, cfg, bias, load_summed)
    assert torch.equal(ids, ids_summed) and torch.equal(weights, weights_summed) and torch.equal(load, load_summed)
    ref_w, ref_ids = fused_route_ref(logits, cfg, bias, load_ref)
    assert torch.equal(ids, ref_ids) and torch.equal(load, load_ref)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=0.0)


def test_sum_partials_order(device):
    """Left to right: (1 + 2^-24) + 2^-24 rounds to 1 twice; summed the other way round it would not."""
    tiny = 2.0 ** -24
    partials = torch.tensor([1.0, tiny, tiny], device=device).reshape(3, 1, 1)
    assert sum_partials(partials).item() == 1.0
    assert sum_partials(partials.flip(0)).item() > 1.0


def test_router_splits(device, h200_splits):
    """Powers of two (a route kernel each), at most 16 and at most the K steps (32 wide), 2 programs an SM, and
    none once the 16 x 16 tiles alone give that."""
    dev = torch.device(device)
    assert router_splits(17, 64, 2048, dev) == 16                  # 8 tiles
    assert router_splits(128, 64, 2048, dev) == 16                 # 32 tiles: 9 wanted
    assert router_splits(256, 64, 2048, dev) == 8                  # 64 tiles: 5 wanted
    assert router_splits(512, 128, 2048, dev) == 2                 # 256 tiles, just short of 264
    assert router_splits(512, 256, 7168, dev) == 1                 # 512 tiles
    assert router_splits(17, 64, 40, dev) == 2                     # 2 K steps (the second partial)
    assert router_splits(17, 64, 96, dev) == 2                     # 3 K steps: a power of two
    assert router_splits(17, 64, 100, dev) == 4                    # 4 K steps
    # The tensor-core tiles: 16 tokens x 64 experts x 64 of the hidden dim.
    assert router_splits(128, 64, 2048, dev, MMA_TILES) == 16      # 8 tiles: 33 wanted
    assert router_splits(512, 64, 2048, dev, MMA_TILES) == 16      # 32 tiles: 9 wanted
    assert router_splits(512, 256, 7168, dev, MMA_TILES) == 4      # 128 tiles: 3 wanted


def test_router_logit_partials_sizes():
    """The two gate kernels split 1..ROUTER_TILED_MAX_TOKENS tokens between them for float32 x on a float32 gate
    (CUDA cores), 1..ROUTER_MMA_MAX_TOKENS for bf16 x on a float32 gate or a gate in x's half-precision dtype
    (tensor cores); beyond, cuBLAS. Mixed half-precision pairs take cuBLAS above the GEMV's sizes."""
    w32 = torch.zeros(4, 8)
    for x_dtype, w, most in ((torch.float32, w32, ROUTER_TILED_MAX_TOKENS),
                             (torch.bfloat16, w32, ROUTER_MMA_MAX_TOKENS),
                             (torch.bfloat16, w32.bfloat16(), ROUTER_MMA_MAX_TOKENS),
                             (torch.float16, w32.half(), ROUTER_MMA_MAX_TOKENS)):
        for t in range(1, most + 2):
            x = torch.zeros(t, 8, dtype=x_dtype)
            assert router_logits_supported(x) + router_logit_partials_supported(x, w) == (t <= most)
    for x_dtype, w_dtype in ((torch.float32, torch.bfloat16), (torch.float16, torch.bfloat16),
                             (torch.float16, torch.float32)):
        x = torch.zeros(ROUTER_GEMV_MAX_TOKENS + 1, 8, dtype=x_dtype)
        assert router_tiles(x, w32.to(w_dtype)) is None and not router_logit_partials_supported(x, w32.to(w_dtype))
    assert router_logit_partials_supported(torch.zeros(ROUTER_GEMV_MAX_TOKENS + 1, 8), w32)
    assert not router_logit_partials_supported(torch.zeros(ROUTER_TILED_MAX_TOKENS + 1, 8), w32)
    assert not router_logit_partials_supported(torch.zeros(2, 32, 8), w32)


def test_router_routes_the_partials(device, monkeypatch):
    """Router on the kernel path at 17..64 tokens: the partials go to fused_route as they are (no [T, E] logits),
    and `logits` sums them; the results = the torch path's (F.linear + route() + index_add_)."""
    e, cfg = MODELS["deepseek_v3"]
    layer = FusedMoE(96, 16, e, cfg, gate_dtype=torch.float32).to(device)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.2)
    gate = layer.gate
    x = torch.randn(20, 96, device=device)
    with torch.inference_mode():
        monkeypatch.setattr(moe_module, "use_triton", lambda _: False)
        ref_w, ref_ids = gate(x, layer.expert_load)
        ref_load = layer.expert_load.clone()
        ref_logits = gate.logits(x)
        layer.reset_expert_load()
        monkeypatch.setattr(moe_module, "use_triton", lambda _: True)
        shapes = []

        def spy(logits, *args, **kwargs):
            shapes.append(logits.shape)
            return fused_route(logits, *args, **kwargs)
        monkeypatch.setattr(routing, "fused_route", spy)
        weights, ids = gate(x, layer.expert_load)
        logits = gate.logits(x)
    assert len(shapes) == 1 and len(shapes[0]) == 3
    assert torch.equal(logits, sum_partials(router_logit_partials(x, gate.weight)))
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    assert torch.equal(ids, ref_ids) and torch.equal(layer.expert_load, ref_load)
    torch.testing.assert_close(weights, ref_w, rtol=1e-5, atol=0.0)


def test_router_rounds_bf16_gate_partials(device, monkeypatch):
    """A bf16 gate (Qwen3-MoE's) with bf16 x from 17 tokens: the tensor-core partials go to fused_route, which
    rounds their sum to bf16; `logits` is that rounded sum, every logit within one bf16 ulp of cuBLAS's bf16 GEMM
    (full-precision reduction), and the ids and weights are route()'s on those logits."""
    if INTERPRET:
        pytest.skip(INTERPRETER_BF16_DOT)
    e, cfg = MODELS["qwen3_moe"]
    layer = FusedMoE(512, 16, e, cfg, gate_dtype=torch.bfloat16).to(device)
    gate = layer.gate
    with torch.no_grad():
        gate.weight.normal_(0.0, 0.05)
    x = torch.randn(40, 512, device=device).to(torch.bfloat16)
    calls = []

    def spy(logits, *args, **kwargs):
        calls.append((logits.dim(), kwargs.get("round_to")))
        return fused_route(logits, *args, **kwargs)
    monkeypatch.setattr(moe_module, "use_triton", lambda _: True)
    monkeypatch.setattr(routing, "fused_route", spy)
    with torch.inference_mode():
        weights, ids = gate(x)
        logits = gate.logits(x)
    assert calls == [(3, torch.bfloat16)]
    assert torch.equal(logits, sum_partials(router_logit_partials(x, gate.weight), torch.bfloat16))
    ref_w, ref_ids = fused_route_ref(logits, cfg)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=0.0)
    reduced = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    try:
        cublas = torch.nn.functional.linear(x, gate.weight)
    finally:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
    scale = (x.float().abs() @ gate.weight.float().abs().t()).max().item()
    assert_within_ulps(logits.to(torch.bfloat16), cublas, torch.bfloat16, ulps=1, min_exact=0.45,
                       atol=2.0 ** -20 * scale)
