"""MoE layer: every router variant against a per-token reference written from the papers/specs, the expert
backend against a naive loop, load counters, and expert weight loading."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from deepserve.layers.moe import (FusedMoE, PairRows, RoutingConfig, TorchMoE, expert_load, reset_expert_load,
                                  route)

E, K, T = 16, 4, 40


def _logits(seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed)) * scale


def reference_route(logits: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor | None):
    """One token at a time, in plain Python: score, (bias), (group filter), pick, weigh."""
    ids_out, w_out = [], []
    for row in logits.tolist():
        if cfg.scoring == "softmax":
            m = max(row)
            exps = [math.exp(x - m) for x in row]
            scores = [x / sum(exps) for x in exps]
        elif cfg.scoring == "sigmoid":
            scores = [1 / (1 + math.exp(-x)) for x in row]
        else:   # DeepSeek-V4.1: sqrt(softplus(x)), softplus(x) = x above 20
            scores = [math.sqrt(x if x > 20 else math.log1p(math.exp(x))) for x in row]
        choice = [s + (bias[e].item() if bias is not None else 0.0) for e, s in enumerate(scores)]
        allowed = set(range(E))
        if cfg.topk_method != "greedy" and cfg.num_groups > 1:
            size = E // cfg.num_groups
            groups = [choice[g * size:(g + 1) * size] for g in range(cfg.num_groups)]
            if cfg.topk_method == "noaux_tc":
                group_score = [sum(sorted(g, reverse=True)[:2]) for g in groups]
            else:
                group_score = [max(g) for g in groups]
            best = sorted(range(cfg.num_groups), key=lambda g: (-group_score[g], g))[:cfg.topk_groups]
            allowed = {g * size + i for g in best for i in range(size)}
        ids = sorted(allowed, key=lambda e: (-choice[e], e))[:cfg.top_k]
        weights = [scores[e] for e in ids]
        if cfg.renormalize:
            total = sum(weights)
            weights = [w / total for w in weights]
        ids_out.append(ids)
        w_out.append([w * cfg.scaling_factor for w in weights])
    return torch.tensor(w_out), torch.tensor(ids_out)


ROUTERS = {
    "mixtral": RoutingConfig(top_k=K, renormalize=True),
    "qwen3_moe_no_norm": RoutingConfig(top_k=K),
    "deepseek_v2_greedy": RoutingConfig(top_k=K, scaling_factor=16.0),
    "deepseek_v2_group_limited": RoutingConfig(top_k=K, topk_method="group_limited_greedy", num_groups=4,
                                               topk_groups=2, scaling_factor=16.0),
    "deepseek_v3_noaux_tc": RoutingConfig(top_k=K, scoring="sigmoid", topk_method="noaux_tc", num_groups=4,
                                          topk_groups=2, renormalize=True, scaling_factor=2.5),
    "deepseek_v4_1_sqrtsoftplus": RoutingConfig(top_k=K, scoring="sqrtsoftplus", topk_method="noaux_tc",
                                                renormalize=True, scaling_factor=1.5),
}


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_router_matches_reference(name):
    cfg = ROUTERS[name]
    logits = _logits()
    logits[0, :4] = torch.tensor([25.0, 30.0, -25.0, 21.0])     # beyond softplus's linear threshold
    bias = torch.randn(E, generator=torch.Generator().manual_seed(1)) * 0.3 if cfg.uses_bias else None
    weights, ids = route(logits, cfg, bias)
    ref_w, ref_ids = reference_route(logits, cfg, bias)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w.float(), rtol=1e-5, atol=1e-6)


def test_bias_changes_choice_not_weight():
    cfg = ROUTERS["deepseek_v4_1_sqrtsoftplus"]
    logits = _logits(seed=3)
    bias = torch.zeros(E)
    bias[7] = 100.0                                  # expert 7 is always chosen ...
    weights, ids = route(logits, cfg, bias)
    assert (ids == 7).any(dim=1).all()
    scores = F.softplus(logits).sqrt()
    picked = scores.gather(1, ids)                   # ... but weighs by its own score, not the bias
    torch.testing.assert_close(weights, picked / picked.sum(1, keepdim=True) * 1.5)


def test_ties_go_to_the_lower_expert_id():
    cfg = RoutingConfig(top_k=2, scoring="sqrtsoftplus", topk_method="noaux_tc", renormalize=True)
    logits = torch.zeros(3, E)
    logits[1, [3, 9, 12]] = 1.0
    _, ids = route(logits, cfg, torch.zeros(E))
    assert ids.tolist() == [[0, 1], [3, 9], [0, 1]]


def test_v3_router_matches_hf():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf_cfg = transformers.DeepseekV3Config(hidden_size=32, n_routed_experts=E, num_experts_per_tok=K, n_group=4,
                                           topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)
    hf = DeepseekV3TopkRouter(hf_cfg)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(E, 32, generator=gen))
        hf.e_score_correction_bias.copy_(torch.randn(E, generator=gen) * 0.3)
    x = torch.randn(T, 32, generator=gen)
    _, hf_w, hf_ids = hf(x)
    moe = FusedMoE(32, 8, E, ROUTERS["deepseek_v3_noaux_tc"], gate_dtype=torch.float32)
    moe.gate.load_state_dict({"weight": hf.weight, "e_score_correction_bias": hf.e_score_correction_bias})
    weights, ids = moe.gate(x)
    # HF's top-k is unsorted: compare per token as expert -> weight maps.
    for i in range(T):
        ours = dict(zip(ids[i].tolist(), weights[i].tolist()))
        theirs = dict(zip(hf_ids[i].tolist(), hf_w[i].tolist()))
        assert ours.keys() == theirs.keys()
        for e, w in ours.items():
            assert w == pytest.approx(theirs[e], rel=1e-5)


def _naive_experts(x, w13, w2, weights, ids, limit=None):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate, up = (w13[e] @ x[t]).chunk(2)
            if limit is not None:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            out[t] += w * (w2[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize("limit", [None, 0.5])
def test_torch_backend_matches_naive_loop(limit):
    gen = torch.Generator().manual_seed(4)
    hidden, inter = 24, 12
    x = torch.randn(T, hidden, generator=gen)
    w13 = torch.randn(E, 2 * inter, hidden, generator=gen) * 0.3
    w2 = torch.randn(E, hidden, inter, generator=gen) * 0.3
    # Only experts 0..5 get tokens: the backend must skip the empty ones.
    ids = torch.stack([torch.randperm(6, generator=gen)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=gen)
    got = TorchMoE().forward(x, w13, w2, weights, ids, swiglu_limit=limit)
    torch.testing.assert_close(got, _naive_experts(x, w13, w2, weights, ids, limit), rtol=1e-5, atol=1e-5)


def test_pair_rows_combine_and_select_tokens():
    """PairRows (a MoE layer's output before its combine): combined() is each token's rows summed in slot order plus
    the shared row, rounded once (against a float64 sum); pairs[idx] holds the tokens idx picks."""
    gen = torch.Generator().manual_seed(5)
    t, k, hidden = 7, 3, 16
    rows = (torch.randn(t * k, hidden, generator=gen) * 4).to(torch.bfloat16)
    shared = torch.randn(t, hidden, generator=gen).to(torch.bfloat16)
    pairs = PairRows(rows, k, shared)
    exact = rows.double().view(t, k, hidden).sum(1) + shared.double()
    got = pairs.combined()
    assert got.dtype == torch.bfloat16 and got.shape == (t, hidden)
    # One rounding of a float32 sum: within half a bf16 ulp (at most 2^-8 of the value) of the exact sum; rounding
    # each partial sum to bf16 (two or more roundings) would not hold to it.
    assert ((got.double() - exact).abs() <= exact.abs() * 2.0 ** -8 * 1.001 + 1e-6).all()
    idx = torch.tensor([5, 0, 5])
    picked = pairs[idx]
    assert picked.num_tokens == 3 and torch.equal(picked.combined(), got[idx])
    assert torch.equal(pairs[1:3].combined(), got[1:3])
    routed_only = PairRows(rows, k).combined().double()
    assert ((routed_only - (exact - shared.double())).abs() <= routed_only.abs() * 2.0 ** -7 + 1e-6).all()


def _moe(shared: int = 0) -> FusedMoE:
    torch.manual_seed(0)
    moe = FusedMoE(24, 12, E, ROUTERS["mixtral"], shared_intermediate_size=shared)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return moe


def test_shared_experts_are_added():
    moe = _moe(shared=20)
    x = torch.randn(5, 24)
    weights, ids = moe.gate(x)
    routed = TorchMoE().forward(x, moe.w13, moe.w2, weights, ids)
    torch.testing.assert_close(moe(x), routed + moe.shared_experts(x))


def test_expert_load_counts_each_step_and_resets():
    moe = _moe()
    x = torch.randn(T, 24)
    with torch.inference_mode():
        moe(x)
        _, ids = moe.gate(x)
        expected = torch.bincount(ids.flatten(), minlength=E)
        assert torch.equal(moe.expert_load, expected)
        moe(x[:3])                                   # accumulates until the engine resets
    assert moe.expert_load.sum().item() == (T + 3) * K
    assert expert_load([moe, moe]).shape == (2, E)
    reset_expert_load([moe])
    assert moe.expert_load.sum().item() == 0


def test_loads_per_expert_and_stacked_names():
    hidden, inter = 24, 12
    moe = FusedMoE(hidden, inter, 4, RoutingConfig(top_k=2), shared_intermediate_size=8)
    gen = torch.Generator().manual_seed(5)
    filled = set()
    pieces = {}
    for e in range(4):
        for proj, shape in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter))):
            pieces[(e, proj)] = torch.randn(*shape, generator=gen)
            filled.add(moe.load_weight(f"experts.{e}.{proj}.weight", pieces[(e, proj)]))
    for proj in ("gate_proj", "up_proj", "down_proj"):
        shape = (hidden, 8) if proj == "down_proj" else (8, hidden)
        filled.add(moe.load_weight(f"shared_experts.{proj}.weight", torch.randn(*shape, generator=gen)))
    filled.add(moe.load_weight("gate.weight", torch.randn(4, hidden, generator=gen)))
    assert filled - {None} == {"w13", "w2", "gate.weight", "shared_experts.gate_up_proj.weight",
                               "shared_experts.down_proj.weight"}
    assert torch.equal(moe.w13[2, :inter], pieces[(2, "w1")])
    assert torch.equal(moe.w13[2, inter:], pieces[(2, "w3")])
    assert torch.equal(moe.w2[3], pieces[(3, "w2")])
    # transformers 5's in-memory layout: the whole stack at once.
    other = FusedMoE(hidden, inter, 4, RoutingConfig(top_k=2))
    assert other.load_weight("experts.gate_up_proj", moe.w13.detach()) == "w13"
    assert other.load_weight("experts.down_proj", moe.w2.detach()) == "w2"
    assert torch.equal(other.w13, moe.w13)


def test_missing_expert_leaves_the_stack_unfinished():
    moe = FusedMoE(8, 4, 3, RoutingConfig(top_k=1))
    results = [moe.load_weight(f"experts.{e}.down_proj.weight", torch.zeros(8, 4)) for e in (0, 2)]
    assert results == [None, None]
    with pytest.raises(KeyError):
        moe.load_weight("experts.3.down_proj.weight", torch.zeros(8, 4))
    with pytest.raises(ValueError):
        moe.load_weight("experts.1.down_proj.weight", torch.zeros(4, 8))


def test_bad_routing_config():
    with pytest.raises(ValueError, match="scoring"):
        RoutingConfig(top_k=2, scoring="relu")
    with pytest.raises(ValueError, match="groups"):
        FusedMoE(8, 4, 6, RoutingConfig(top_k=2, topk_method="noaux_tc", scoring="sigmoid", num_groups=4))
    with pytest.raises(ValueError, match="allowed groups"):
        FusedMoE(8, 4, 8, RoutingConfig(top_k=3, topk_method="noaux_tc", scoring="sigmoid", num_groups=4))
