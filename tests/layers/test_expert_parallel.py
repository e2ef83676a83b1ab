"""layers/expert_parallel.py on gloo CPU processes: an EP layer's output on each rank's own tokens equals the
single-process FusedMoE's (ep 2 and 4, redundant replicas, TP inside EP, a rank with no tokens), still does after
`move_experts` to new maps, whose local slots then hold the right experts' weights; and clear errors for what
cannot be spread."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from deepserve.eplb import rebalance
from deepserve.layers.expert_parallel import enable_expert_parallel, move_experts
from deepserve.layers.mlp import GatedMLP
from deepserve.layers.moe import FusedMoE, RoutingConfig
from deepserve.layers.rank_group import RankGroup
from tests.parallel.gloo_harness import make_groups, run_ranks

H, I, E, K = 32, 16, 8, 2


def _layer(shared: bool) -> FusedMoE:
    """The same seeded weights in every process."""
    torch.manual_seed(0)
    layer = FusedMoE(H, I, E, RoutingConfig(top_k=K, renormalize=True), shared_intermediate_size=I if shared else 0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    return layer


def _shard_shared(layer: FusedMoE, tp: RankGroup) -> None:
    """What a model's TP sharding does to the shared experts: gate/up rows and down columns split over tp."""
    full, n = layer.shared_experts, I // tp.size
    part = GatedMLP(H, n)
    keep = slice(tp.rank * n, (tp.rank + 1) * n)
    gate, up = full.gate_up_proj.weight[:I], full.gate_up_proj.weight[I:]
    with torch.no_grad():
        part.gate_up_proj.weight.copy_(torch.cat([gate[keep], up[keep]]))
        part.down_proj.weight.copy_(full.down_proj.weight[:, keep])
    layer.shared_experts = part


def _maps(ep_size: int, physical: int) -> list[torch.Tensor]:
    """Two new placements, the same on every rank: EPLB's on a skewed load, then a seeded shuffle with replicas."""
    g = torch.Generator().manual_seed(1)
    load = torch.rand(4, 1, E, generator=g) * (torch.arange(E) + 1.0) ** 3
    shuffled = torch.cat([torch.randperm(E, generator=g), torch.randint(E, (physical - E,), generator=g)])
    return [rebalance(load, ep_size, physical).physical_to_logical[0], shuffled[torch.randperm(physical, generator=g)]]


def _ep_rank(rank: int, world: int, tp: int, ep: int, extra: int, shared: bool, rows: list[int]) -> bool:
    ctx = make_groups(rank, world, tp, ep)
    layer = _layer(shared)
    reference = copy.deepcopy(layer)
    full_w13, full_w2 = layer.w13.detach().clone(), layer.w2.detach().clone()
    # TP ranks of one replica see the same tokens; replicas (and so ranks) differ, one of them may have none.
    replica = rank // tp
    x = torch.randn(rows[replica], H, generator=torch.Generator().manual_seed(100 + replica))
    with torch.no_grad():
        expected = reference(x)
        if shared and tp > 1:
            _shard_shared(layer, ctx.tp)
        layer.tp = ctx.tp
        physical = E + extra
        enable_expert_parallel([layer], ctx.ep, ctx.tp, physical)
        local = physical // ep
        assert layer.w13.shape == (local, 2 * I, H) and layer.w2.shape == (local, H, I)
        torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
        for new in _maps(ep, physical):
            move_experts(layer, new)
            mine = new[ctx.ep.rank * local:(ctx.ep.rank + 1) * local]
            assert torch.equal(layer.w13, full_w13[mine]) and torch.equal(layer.w2, full_w2[mine])
            assert torch.equal(layer.expert_parallel.physical_to_logical, new)
            torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    # Every row the gate saw is counted, on every TP rank (each forward above saw x).
    assert int(layer.expert_load.sum()) == 3 * rows[replica] * K
    return True


@pytest.mark.parametrize("world,tp,ep,extra,shared,rows", [
    (2, 1, 2, 0, True, [6, 0]),         # ep 2, one idle rank (its placeholder forward still enters the collectives)
    (2, 1, 2, 2, False, [9, 4]),        # ep 2 with one redundant replica per rank
    pytest.param(4, 1, 4, 4, True, [5, 0, 7, 3], marks=pytest.mark.slow),   # ep 4 with replicas (the next has both)
    (4, 2, 4, 4, True, [7, 4]),         # tp 2 inside ep 4, shared experts TP-sharded
])
def test_expert_parallel_matches_one_process(world, tp, ep, extra, shared, rows):
    assert run_ranks(_ep_rank, world, tp, ep, extra, shared, rows, timeout=90) == [True] * world


def _fake_group(size: int) -> RankGroup:
    return RankGroup(0, size, group=object(), ranks=tuple(range(size)))     # validation runs before any collective


@pytest.mark.parametrize("physical", [10, 6])
def test_physical_slots_that_do_not_split_are_refused(physical):
    with pytest.raises(ValueError, match="num_redundant_experts.*expert_parallel_size 4"):
        enable_expert_parallel([_layer(False)], _fake_group(4), RankGroup(), physical)


def test_quantized_experts_are_refused():
    layer = _layer(False)
    layer.w13 = nn.Parameter(layer.w13.detach().to(torch.int8), requires_grad=False)
    with pytest.raises(ValueError, match="plain float Parameter"):
        enable_expert_parallel([layer], _fake_group(2), RankGroup(), E)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_one_rank_with_replicas_in_process(dtype, atol):
    """ep 1 (every collective the identity): the packed rows (weights and slots riding in x's dtype) and the
    replica choice, in bf16 too, where a pair's output is rounded before the float32 combine."""
    layer = _layer(True).to(dtype)
    reference = copy.deepcopy(layer)
    x = torch.randn(11, H, generator=torch.Generator().manual_seed(5)).to(dtype)
    with torch.no_grad():
        expected = reference(x)
        enable_expert_parallel([layer], RankGroup(), RankGroup(), E + 3)
        assert layer.w13.shape[0] == E + 3 and layer.w13.dtype == dtype
        got = layer(x)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=atol)
        move_experts(layer, _maps(1, E + 3)[1])
        torch.testing.assert_close(layer(x).float(), expected.float(), atol=atol, rtol=atol)
