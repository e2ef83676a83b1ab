"""Fused MoE kernels (align, grouped gate/up + SwiGLU, grouped down + router weight, the pair mode's GEMVs, combine
with the shared experts' output) and the TritonMoE backend against the PyTorch reference backend TorchMoE."""

import pytest
import torch

from deepserve.kernels import INTERPRET
import deepserve.kernels.fused_moe as fused_moe_module
from deepserve.kernels.fused_moe import (PAIR_MODE_MAX_PAIRS, MoEConfig, MoEPairConfig, fused_moe, fused_moe_ref,
                                         moe_combine, pick_pair_config, use_pair_mode)
import deepserve.kernels.moe_align as moe_align_module
from deepserve.kernels.moe_align import SINGLE_ALIGN_MAX_PAIRS, align_max_rows, moe_align, moe_align_ref
import deepserve.layers.moe_triton as moe_triton_module
from deepserve.layers.moe_triton import (FUSED_SHARED_MAX_TOKENS, FUSED_SHARED_MAX_TOKENS_LARGE, TritonMoE,
                                         fused_shared_max_tokens, plain_shared_weights)
from deepserve.kernels.reference.moe import PairRows
from deepserve.layers.moe import FusedMoE, RoutingConfig
from kernel_testing import skip_bf16_in_interpreter

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Relative Frobenius error and max abs error / max |ref|. fp32: IEEE products, only the summation order
# differs. Half types: the kernel keeps gate/up in float32 through the SwiGLU and rounds the weighted pair
# rows once, the reference rounds gate/up, the activation and each pair's row to the dtype. Both modes (aligned
# and pair) and the shared experts' output (added in float32, one rounding, in both) are under the same bounds.
MOE_TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (3e-3, 1e-2), torch.bfloat16: (2e-2, 5e-2)}


@pytest.fixture(autouse=True)
def _interpreter_scalars(monkeypatch):
    """Triton 3.6's interpreter holds kernel scalars as 1-element arrays and numpy >= 2.3 refuses int() of
    those, so `range(0, n)` over a scalar argument fails under TRITON_INTERPRET=1. Take the element instead."""
    if not INTERPRET:
        return
    import triton.runtime.interpreter as interp
    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    monkeypatch.setattr(interp, "_patch_lang_tensor", patched)


def _weights(num_experts, hidden, inter, dtype, device):
    """Expert stacks scaled by 1/sqrt(fan_in): activations of order 1 at every stage."""
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=device) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, device=device) / inter ** 0.5
    return w13.to(dtype), w2.to(dtype)


def _routing(t, num_experts, top_k, device, experts=None):
    """Random distinct experts per token (from `experts` if given) and random positive weights."""
    pool = torch.arange(num_experts) if experts is None else torch.tensor(experts)
    ids = torch.stack([pool[torch.randperm(len(pool))[:top_k]] for _ in range(t)])
    weights = torch.rand(t, top_k) + 0.1
    return weights.to(device), ids.to(device)


def _check(out, ref, dtype):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    o, r = out.float(), ref.float()
    assert torch.isfinite(o).all()
    rel = ((o - r).norm() / r.norm()).item()
    max_rel = ((o - r).abs().max() / r.abs().max()).item()
    rel_tol, max_tol = MOE_TOL[dtype]
    assert rel < rel_tol and max_rel < max_tol, f"rel {rel:.2e} (tol {rel_tol}), max {max_rel:.2e} (tol {max_tol})"


def _inputs(device, dtype, t, num_experts, top_k, hidden, inter, experts=None, shared=False):
    """x, w13, w2, router weights, expert ids, and (with `shared`) a shared experts' output of order 1."""
    x = torch.randn(t, hidden, device=device).to(dtype)
    w13, w2 = _weights(num_experts, hidden, inter, dtype, device)
    weights, ids = _routing(t, num_experts, top_k, device, experts)
    shared_out = torch.randn(t, hidden, device=device).to(dtype) if shared else None
    return x, w13, w2, weights, ids, shared_out


def _run(device, dtype, t, num_experts, top_k, hidden, inter, experts=None, limit=None, config=None, shared=False):
    x, w13, w2, weights, ids, shared_out = _inputs(device, dtype, t, num_experts, top_k, hidden, inter, experts,
                                                   shared)
    out = fused_moe(x, w13, w2, weights, ids, limit, config=config, shared_out=shared_out)
    _check(out, fused_moe_ref(x, w13, w2, weights, ids, limit, shared_out=shared_out), dtype)


# (T, E, top_k, H, I): batch-1 decode (DeepSeek-like fan-out; pair mode by the heuristic), odd sizes that need
# masks, top-1 (no combine), more tokens than one block per expert.
SHAPES = [(1, 8, 2, 64, 32), (1, 64, 6, 128, 96), (7, 16, 4, 96, 80), (33, 4, 1, 64, 48), (70, 8, 2, 64, 64)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-E{}-k{}-H{}-I{}".format(*s))
def test_fused_moe_matches_reference(device, dtype, shape):
    skip_bf16_in_interpreter(dtype)
    _run(device, dtype, *shape)


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_tokens_to_one_expert(device, dtype):
    """Top-1 to one expert (one long run, several blocks), then top-2 over the same two experts."""
    skip_bf16_in_interpreter(dtype)
    _run(device, dtype, 50, 8, 1, 64, 32, experts=[5])
    _run(device, dtype, 50, 8, 2, 64, 32, experts=[0, 7])


def test_experts_without_tokens(device):
    """32 experts, only 3 of them routed to: the others get no block and no work."""
    _run(device, torch.float32, 20, 32, 2, 64, 32, experts=[3, 17, 30])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_limit(device, dtype):
    """DeepSeek-V4.1's clamp, with a limit low enough that it cuts many gate and up values."""
    skip_bf16_in_interpreter(dtype)
    _run(device, dtype, 9, 8, 3, 64, 32, limit=0.5)


@pytest.mark.parametrize("config", [MoEConfig(16, 32, 32, 128), MoEConfig(32, 64, 64), MoEConfig(64, 64, 128, 32),
                                    MoEConfig(128, 128, 128, num_warps=8)],
                         ids=lambda c: f"M{c.block_m}-N{c.block_n_up}-{c.block_n_down}-K{c.block_k}")
def test_tile_configs(device, config):
    """Every block shape the heuristic picks, forced, on sizes that are not multiples of the tiles."""
    _run(device, torch.float32, 37, 6, 2, 80, 72, config=config)


# --- pair mode ------------------------------------------------------------------------------------

# Tiles small enough that the test shapes take several K steps, N tiles and masked tails in both GEMVs.
SMALL_PAIR_TILES = MoEPairConfig(block_n_up=8, block_n_down=16, block_k=32)
# (T, E, top_k, H, I, swiglu_limit, shared_out): H and I are no multiples of the tiles.
PAIR_CASES = [
    (1, 8, 1, 72, 44, None, False),      # top-1 without shared experts: no combine
    (1, 8, 1, 72, 44, None, True),       # top-1 with them: the combine runs for the add
    (2, 8, 2, 100, 36, 0.5, False),      # the clamp cuts many gate and up values
    (3, 8, 6, 72, 44, None, True),       # 18 pairs on 8 experts: experts picked by several tokens
    (1, 64, 6, 100, 56, 0.5, True),      # DeepSeek-like batch-1 decode
    (2, 64, 8, 100, 44, 0.5, True),
    (3, 64, 8, 72, 36, None, False),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", PAIR_CASES, ids=lambda c: "T{}-E{}-k{}-H{}-I{}-limit{}-shared{}".format(*c))
def test_pair_mode_matches_reference(device, dtype, case):
    skip_bf16_in_interpreter(dtype)
    t, num_experts, top_k, hidden, inter, limit, shared = case
    _run(device, dtype, t, num_experts, top_k, hidden, inter, limit=limit, config=SMALL_PAIR_TILES, shared=shared)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pair_mode_with_picked_tiles(device, dtype):
    """The heuristic's tiles (BLOCK_K capped at the small test shapes) on a batch the heuristic sends to pair mode."""
    skip_bf16_in_interpreter(dtype)
    assert use_pair_mode(2 * 6, 64)
    _run(device, dtype, 2, 64, 6, 136, 72, limit=0.5, shared=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pair_and_aligned_modes_agree(device, dtype):
    """Both modes forced on the same inputs (16 pairs on 8 experts: shared experts, several tokens per block).
    fp32: exact products in both, only the summation order differs."""
    skip_bf16_in_interpreter(dtype)
    x, w13, w2, weights, ids, shared_out = _inputs(device, dtype, 4, 8, 4, 72, 44, shared=True)
    pair = fused_moe(x, w13, w2, weights, ids, 0.5, config=SMALL_PAIR_TILES, shared_out=shared_out)
    aligned = fused_moe(x, w13, w2, weights, ids, 0.5, config=MoEConfig(16, 32, 32, 32), shared_out=shared_out)
    if dtype == torch.float32:
        torch.testing.assert_close(pair, aligned, rtol=1e-5, atol=1e-5)
    else:
        _check(pair, aligned, dtype)


def test_pair_mode_threshold():
    """Pair mode for at most one pair per two experts and at most PAIR_MODE_MAX_PAIRS pairs."""
    assert use_pair_mode(6, 64) and use_pair_mode(5 * 6, 64) and use_pair_mode(2, 8)
    assert not use_pair_mode(8 * 6, 64)                  # more pairs than half the experts (V2-Lite, batch 8)
    assert not use_pair_mode(5 * 8, 128)                 # the cap (Qwen3-MoE past batch 4)
    assert use_pair_mode(4 * 8, 128) and use_pair_mode(PAIR_MODE_MAX_PAIRS, 1024)
    assert not use_pair_mode(PAIR_MODE_MAX_PAIRS + 1, 1024)


@pytest.mark.parametrize("top_k,inter,hidden", [(6, 1408, 2048), (8, 768, 2048), (2, 14336, 4096), (8, 2048, 7168)],
                         ids=["deepseek-v2-lite", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3"])
def test_pair_tiles_fill_an_h200(monkeypatch, top_k, inter, hidden):
    """Real shapes at batch 1 on 132 SMs: 16-byte loads per lane along K, and >= 3 programs per SM in both GEMVs."""
    monkeypatch.setattr(fused_moe_module, "num_sms", lambda device: 132)
    for dtype in (torch.bfloat16, torch.float32):
        cfg = pick_pair_config(top_k, inter, hidden, dtype, torch.device("cuda"))
        assert cfg.block_k * dtype.itemsize == 32 * 16
        assert top_k * -(-inter // cfg.block_n_up) >= 3 * 132
        assert top_k * -(-hidden // cfg.block_n_down) >= 3 * 132


# --- combine --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("top_k", [1, 2, 6])
def test_combine_with_shared_out_is_exact(device, dtype, top_k):
    """out[t] = pair rows of t added in slot order, then the shared output, in float32, rounded once: the same
    float32 additions in torch give the same bits."""
    skip_bf16_in_interpreter(dtype)
    t, hidden = 3, 1100                     # two hidden blocks, the second one masked
    pair_out = torch.randn(t * top_k, hidden, device=device).to(dtype)
    shared_out = torch.randn(t, hidden, device=device).to(dtype)
    expected = torch.zeros(t, hidden, device=device)
    for j in range(top_k):
        expected += pair_out.view(t, top_k, hidden)[:, j].float()
    expected = (expected + shared_out.float()).to(dtype)
    assert torch.equal(moe_combine(pair_out, top_k, shared_out), expected)
    if top_k == 1:
        assert moe_combine(pair_out, 1) is pair_out         # nothing to add: no launch


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 16, 4, 96, 80), (33, 4, 1, 64, 48)], ids=["k4", "k1"])
def test_aligned_mode_with_shared_out(device, dtype, shape):
    """The shared experts' output through the aligned mode's combine (top-1 included) against TorchMoE."""
    skip_bf16_in_interpreter(dtype)
    _run(device, dtype, *shape, config=MoEConfig(16, 32, 32, 64), shared=True)


# (T, E, top_k, H, I, shared intermediate S, swiglu_limit): S = 2I (V2-Lite's two shared experts), S not a
# multiple of I (a partial last chunk), S < I; the shared token blocks (fused_moe.shared_tiles) one routed block
# of 16 rows (T = 7, 5), one taller block (T = 20, 33: 32 and 64 rows), two of 64 with a partial last one (T = 100).
SHARED_CASES = [(7, 16, 4, 96, 80, 160, None), (33, 4, 1, 64, 48, 80, 0.5), (5, 8, 2, 72, 44, 36, None),
                (20, 8, 6, 72, 32, 96, 0.5), (100, 8, 2, 72, 32, 96, None)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", SHARED_CASES, ids=lambda c: "T{}-E{}-k{}-H{}-I{}-S{}-limit{}".format(*c))
@pytest.mark.parametrize("config", [MoEConfig(16, 32, 32, 32), SMALL_PAIR_TILES], ids=["aligned", "pair-mode"])
def test_shared_weights_match_reference(device, dtype, case, config):
    """The shared experts given as weights: the aligned mode runs them as the first blocks of its two grouped
    GEMMs (chunks of I columns, the whole S in the down GEMM's K loop), the pair mode in torch; both against
    TorchMoE with the shared SwiGLU computed as GatedMLP does."""
    skip_bf16_in_interpreter(dtype)
    t, num_experts, top_k, hidden, inter, shared_inter, limit = case
    x, w13, w2, weights, ids, _ = _inputs(device, dtype, t, num_experts, top_k, hidden, inter)
    gate_up = (torch.randn(2 * shared_inter, hidden, device=device) / hidden ** 0.5).to(dtype)
    down = (torch.randn(hidden, shared_inter, device=device) / shared_inter ** 0.5).to(dtype)
    out = fused_moe(x, w13, w2, weights, ids, limit, config=config, shared_weights=(gate_up, down))
    _check(out, fused_moe_ref(x, w13, w2, weights, ids, limit, shared_weights=(gate_up, down)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [MoEConfig(16, 32, 32), SMALL_PAIR_TILES], ids=["aligned", "pair-mode"])
@pytest.mark.parametrize("shared", ["none", "out", "weights"])
def test_uncombined_output_is_the_combines_input(device, dtype, config, shared):
    """combine=False: no combine launch; the PairRows it returns combine (in torch, slot order, float32) to the
    combined call's output bit for bit: the pair rows are the weighted, rounded rows the combine kernel reads, and
    the shared output the one it adds (given, or computed in the grouped GEMMs / by torch in the pair mode)."""
    skip_bf16_in_interpreter(dtype)
    t, hidden, inter = 24, 64, 32
    x, w13, w2, weights, ids, shared_out = _inputs(device, dtype, t, 16, 4, hidden, inter, shared=shared == "out")
    kw = {"config": config, "shared_out": shared_out}
    if shared == "weights":
        kw["shared_weights"] = ((torch.randn(96, hidden, device=device) / 8).to(dtype),
                                (torch.randn(hidden, 48, device=device) / 7).to(dtype))
    combined = fused_moe(x, w13, w2, weights, ids, **kw)
    pairs = fused_moe(x, w13, w2, weights, ids, combine=False, **kw)
    assert isinstance(pairs, PairRows) and pairs.top_k == 4 and pairs.pair_out.shape == (t * 4, hidden)
    assert (pairs.shared_out is None) == (shared == "none")
    assert torch.equal(pairs.combined(), combined)
    assert torch.equal(moe_combine(pairs.pair_out, 4, pairs.shared_out), combined)


def test_empty_batch(device):
    x = torch.zeros(0, 64, device=device)
    w13, w2 = _weights(4, 64, 32, torch.float32, device)
    out = fused_moe(x, w13, w2, torch.zeros(0, 2, device=device), torch.zeros(0, 2, dtype=torch.int64, device=device))
    assert out.shape == (0, 64)


# --- align ---------------------------------------------------------------------------------------

def _check_alignment(align, ids, num_experts):
    """Every pair exactly once; each block's real rows all routed to its expert; used blocks first, in expert
    order, real rows before the padding of a run; padding rows hold num_pairs."""
    flat = ids.flatten().cpu()
    n = flat.numel()
    experts = align.block_expert.cpu()
    used = experts >= 0
    num_used = int(used.sum())
    assert not used[num_used:].any(), "unused blocks must come last"
    assert num_used == sum(-(-int((flat == e).sum()) // align.block_m) for e in range(num_experts))
    assert (experts[used].diff() >= 0).all()
    pairs = align.sorted_pairs.cpu().view(-1, align.block_m)[:num_used]     # rows past the runs are never read
    real = pairs[pairs < n]
    assert sorted(real.tolist()) == list(range(n)) and (pairs <= n).all()
    for block, expert in zip(pairs, experts[used].tolist()):
        rows = block[block < n]
        assert len(rows) and (flat[rows] == expert).all()
        assert (block[:len(rows)] < n).all(), "padding only at the end of a run"


@pytest.mark.parametrize("num_pairs,num_experts,block_m", [(1, 4, 16), (6, 64, 16), (40, 8, 16), (300, 16, 32),
                                                           (64, 4, 64), (5000, 128, 64), (700, 256, 16),
                                                           (768, 64, 32), (2048, 128, 32), (1000, 60, 64),
                                                           (SINGLE_ALIGN_MAX_PAIRS, 128, 16)])
@pytest.mark.parametrize("mode", ["gather", "scratch", "one-hot"])
def test_align_matches_reference(device, num_pairs, num_experts, block_m, mode, monkeypatch):
    """The Triton align and the stable-sort torch twin: both valid layouts with the same blocks (expert of
    every block). Inside a run the Triton order may differ (atomic ranks on the GPU), which no result sees.
    Covers its launch shapes: one program with atomics (up to 2048 pairs: V2-Lite's batch 128 is 768 pairs of 64
    experts, Qwen3-MoE's batch 256 2048 of 128), its run starts gathered in registers and its blocks stored
    (`gather`, DEEPSERVE_MOE_ALIGN_GATHER, the default) or both looked up in its scratch (`scratch`), three
    launches (5000), and with `one-hot` (ONE_HOT_MAX_PAIRS raised, as ab_kernel_modes' align_one_hot does) one
    program counting in registers where its tiles hold every pair and block (up to 40 pairs here)."""
    if mode == "one-hot":
        monkeypatch.setattr(moe_align_module, "ONE_HOT_MAX_PAIRS", 1 << 30)
    monkeypatch.setattr(moe_align_module, "ALIGN_GATHER", mode == "gather")
    ids = torch.randint(0, num_experts, (num_pairs, 1), device=device)
    if num_pairs >= 40:
        ids[: num_pairs // 2] = 1     # a hot expert with many blocks next to cold and empty ones
    reference = moe_align_ref(ids, num_experts, block_m)
    aligned = moe_align(ids, num_experts, block_m)
    _check_alignment(reference, ids, num_experts)
    _check_alignment(aligned, ids, num_experts)
    assert torch.equal(aligned.block_expert, reference.block_expert)
    assert reference.sorted_pairs.shape[0] == align_max_rows(num_pairs, num_experts, block_m)


def test_decode_touches_only_the_routed_experts(device):
    """Batch-1 decode with top-6 of 64 experts: exactly 6 blocks do work, one per routed expert, so the GEMMs
    read those 6 experts' weights and no others."""
    ids = torch.tensor([[41, 3, 60, 7, 22, 9]], device=device)
    align = moe_align(ids, 64, 16)
    active = align.block_expert[align.block_expert >= 0].tolist()
    assert active == sorted(ids[0].tolist())
    assert align.num_blocks == 6


# --- backend --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config,tokens", [(None, 13), (SMALL_PAIR_TILES, 13), (None, FUSED_SHARED_MAX_TOKENS + 1)],
                         ids=["picked", "pair-mode", "picked-past-the-fusion"])
@pytest.mark.parametrize("shared", ["fused", "module", "side-stream"])
def test_backend_in_moe_layer(device, dtype, config, tokens, shared, monkeypatch):
    """A whole FusedMoE layer (router, shared experts) with TritonMoE equals the same layer on TorchMoE, on 16
    experts: the aligned mode when picked (with DEEPSERVE_MOE_SHARED_STREAM=0, the shared experts' weights in its
    grouped GEMMs up to FUSED_SHARED_MAX_TOKENS tokens, unless DEEPSERVE_MOE_FUSED_SHARED=0), and the pair mode
    forced (the shared experts as their own module); by default, on CUDA, the shared experts on the side stream
    (their output handed in, joined before the combine), in the interpreter as "fused"."""
    skip_bf16_in_interpreter(dtype)
    if tokens > 13 and (INTERPRET or dtype != torch.bfloat16):
        pytest.skip("the threshold's side: once, on the GPU")
    monkeypatch.setenv("DEEPSERVE_MOE_SHARED_STREAM", "1" if shared == "side-stream" else "0")
    monkeypatch.setenv("DEEPSERVE_MOE_FUSED_SHARED", "0" if shared == "module" else "1")
    beside = shared == "side-stream" and torch.device(device).type == "cuda"
    fuse_shared = shared != "module" and not beside
    calls = []
    real_fused_moe = fused_moe_module.fused_moe

    def spy(*args, **kwargs):
        calls.append(kwargs.get("shared_weights") is not None)
        assert (kwargs.get("shared_out") is not None and not kwargs.get("combine", True)) == beside
        return real_fused_moe(*args, **kwargs)
    monkeypatch.setattr(moe_triton_module, "fused_moe", spy)
    routing = RoutingConfig(top_k=4, topk_method="group_limited_greedy", num_groups=4, topk_groups=2,
                            scaling_factor=2.0)
    layer = FusedMoE(64, 32, 16, routing, shared_intermediate_size=48).to(device)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.2)
    layer = layer.to(dtype)
    x = torch.randn(tokens, 64, device=device).to(dtype)
    with torch.inference_mode():
        ref = layer(x)
        load_ref = layer.expert_load.clone()
        layer.backend = TritonMoE(config)
        out = layer(x)
    _check(out, ref, dtype)
    assert torch.equal(layer.expert_load, 2 * load_ref)
    assert calls == [fuse_shared and config is None and tokens <= FUSED_SHARED_MAX_TOKENS]


def test_fused_shared_bound_follows_the_l2():
    """Shared gate/up weights that fit the L2 (V2-Lite's 23 MB) fuse up to 128 tokens, larger ones (DeepSeek-V3's
    58.7 MB) up to 64: the measured sides of moe_shared_fusion_ab_h200.json."""
    v2_lite = torch.empty(2 * 2816, 2048, dtype=torch.bfloat16, device="meta")
    v3 = torch.empty(2 * 2048, 7168, dtype=torch.bfloat16, device="meta")
    assert fused_shared_max_tokens(v2_lite) == FUSED_SHARED_MAX_TOKENS == 128
    assert fused_shared_max_tokens(v3) == FUSED_SHARED_MAX_TOKENS_LARGE == 64


def test_only_plain_shared_experts_are_fused():
    """Shared experts with a quantized or batch-invariant projection, another clamp or another dtype run as their
    own module."""
    from deepserve.layers.mlp import GatedMLP
    x = torch.zeros(2, 16)
    mlp = GatedMLP(16, 8, swiglu_limit=None)
    assert plain_shared_weights(mlp, x, None) is not None
    assert plain_shared_weights(mlp, x, 7.0) is None
    assert plain_shared_weights(mlp, x.half(), None) is None
    mlp.down_proj.batch_invariant = True
    assert plain_shared_weights(mlp, x, None) is None
    mlp.down_proj.batch_invariant = False
    mlp.gate_up_proj = torch.nn.Linear(16, 16, bias=False)       # stands in for a quantized replacement
    assert plain_shared_weights(mlp, x, None) is None


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("t", [2, 8], ids=["pair-mode", "aligned"])
def test_moe_layer_in_cuda_graph(device, t):
    """A FusedMoE layer on TritonMoE captured in a CUDA graph (fixed shapes, no host sync) and replayed on new
    inputs written into the captured tensor: equals the eager layer each time. Top-4 of 16 experts: 2 tokens run
    the pair mode, 8 the aligned one."""
    assert use_pair_mode(t * 4, 16) == (t == 2)
    dtype = torch.bfloat16
    layer = FusedMoE(64, 32, 16, RoutingConfig(top_k=4, renormalize=True), shared_intermediate_size=48).to(device)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.2)
    layer = layer.to(dtype)
    layer.backend = TritonMoE()
    x = torch.randn(t, 64, device=device).to(dtype)
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer(x)                         # compiles outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = layer(x)
        for _ in range(3):
            x.copy_(torch.randn(t, 64, device=device))
            graph.replay()
            torch.cuda.synchronize()
            _check(out, layer(x), dtype)
