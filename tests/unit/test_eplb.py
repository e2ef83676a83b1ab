"""deepserve.eplb: the replication + placement policy of deepinfer.md §7, as a pure function."""

from __future__ import annotations

import pytest
import torch

from deepserve.eplb import Placement, balance_ratio, identity_placement, rebalance


def zipf_loads(s=1.0, steps=50, layers=2, experts=64, assignments=32768, noise=0.1, seed=0):
    """[steps, layers, experts] Poisson counts around a per-layer Zipf popularity (random expert order)
    with per-step log-normal jitter. Popularity is over token-expert assignments; the per-token top-k cap
    that benchmarks/eplb.py models is left out here (it only flattens the head)."""
    gen = torch.Generator().manual_seed(seed)
    rank = torch.stack([torch.randperm(experts, generator=gen) for _ in range(layers)]) + 1
    p = rank.double() ** -s * torch.exp(noise * torch.randn(steps, layers, experts, generator=gen, dtype=torch.float64))
    return torch.poisson(p / p.sum(-1, keepdim=True) * assignments, generator=gen)


def check_consistent(placement: Placement, layers: int, experts: int, physical: int) -> None:
    p2l, l2p, counts = placement.physical_to_logical, placement.logical_to_physical, placement.replica_counts
    assert p2l.dtype == l2p.dtype == counts.dtype == torch.int64
    assert p2l.shape == (layers, physical)
    assert l2p.shape == (layers, experts, physical - experts + 1)
    assert counts.shape == (layers, experts)
    assert ((p2l >= 0) & (p2l < experts)).all()
    for layer in range(layers):
        assert torch.equal(torch.bincount(p2l[layer], minlength=experts), counts[layer])
        slots = l2p[layer][l2p[layer] >= 0]
        assert torch.equal(slots.sort().values, torch.arange(physical))  # every slot listed exactly once
        for e in range(experts):
            row = l2p[layer, e]
            mine = row[: counts[layer, e]]
            assert (row[counts[layer, e] :] == -1).all()  # padding only after the replicas
            assert (p2l[layer, mine] == e).all()
            assert torch.equal(mine, mine.sort().values)


def test_zipf_ratio_after_one_extra_per_rank_within_1_10_from_at_least_1_5():
    ranks, experts = 8, 64
    for s in (0.8, 1.0, 1.2):
        loads = zipf_loads(s=s, experts=experts)
        before = balance_ratio(loads, identity_placement(2, experts, ranks), ranks)
        after = balance_ratio(loads, rebalance(loads, ranks, experts + ranks), ranks)
        assert before >= 1.5, (s, before)
        assert after <= 1.10, (s, after)


def test_more_extra_replicas_never_hurt_on_zipf():
    loads = zipf_loads(s=1.2, experts=64)
    ratios = [balance_ratio(loads, rebalance(loads, 8, 64 + 8 * extra), 8) for extra in (0, 1, 2, 4)]
    assert ratios == sorted(ratios, reverse=True), ratios


def test_capacity_every_rank_holds_exactly_its_slots_and_maps_agree():
    loads = zipf_loads(s=1.2, experts=64, layers=3)
    placement = rebalance(loads, 8, 80)
    check_consistent(placement, 3, 64, 80)
    # Rank r owns slots [10 r, 10 r + 10); all of them hold an expert, and the total is the slot count.
    assert placement.physical_to_logical.view(3, 8, 10).shape == (3, 8, 10)
    assert (placement.replica_counts.sum(1) == 80).all()


def test_every_logical_expert_keeps_a_replica_even_with_no_tokens():
    loads = torch.zeros(10, 2, 16)
    loads[:, :, 0] = 1000.0  # one expert takes everything; the rest are cold
    placement = rebalance(loads, 4, 24)
    assert (placement.replica_counts >= 1).all()
    assert (placement.replica_counts[:, 0] == 9).all()  # all 8 extras go to the only hot expert
    check_consistent(placement, 2, 16, 24)


def test_deterministic_and_integer_counts_equal_float_counts():
    loads = zipf_loads(s=1.0, experts=64)
    first, second = rebalance(loads, 8, 72), rebalance(loads.clone(), 8, 72)
    from_int = rebalance(loads.to(torch.int64), 8, 72)
    for a, b in ((first, second), (first, from_int)):
        assert torch.equal(a.physical_to_logical, b.physical_to_logical)
        assert torch.equal(a.logical_to_physical, b.logical_to_physical)
        assert torch.equal(a.replica_counts, b.replica_counts)


def test_hand_checked_two_ranks_three_experts_one_extra():
    # Replication: a replica for expert 0 makes the max per-replica load 3 (for 1 or 2 it stays 6).
    # Placement, replicas by load 3,3,3,1 (stable): e0 -> rank 0 (tie), e1 -> rank 1 (cost 3 vs 6),
    # e0' -> rank 0 (tie at 6), e2 -> rank 1 (rank 0 full). Ranks carry 6 and 4: ratio 6 / 5.
    loads = torch.tensor([[[6, 3, 1]]])
    placement = rebalance(loads, 2, 4)
    assert placement.physical_to_logical.tolist() == [[0, 0, 1, 2]]
    assert placement.replica_counts.tolist() == [[2, 1, 1]]
    assert placement.logical_to_physical.tolist() == [[[0, 1], [2, -1], [3, -1]]]
    assert balance_ratio(loads, placement, 2) == pytest.approx(1.2)


def test_hand_checked_per_step_objective_pairs_experts_hot_in_different_steps():
    # Equal totals, but experts 0 and 1 are hot in different steps: together on a rank, both ranks carry
    # 4 tokens each step (ratio 1.0). A total-load packing ({0, 2}, {1, 3}) would give 6 vs 2 each step.
    loads = torch.tensor([[[4, 0, 2, 2]], [[0, 4, 2, 2]]])
    placement = rebalance(loads, 2, 4)
    assert placement.physical_to_logical.tolist() == [[0, 1, 2, 3]]
    assert balance_ratio(loads, placement, 2) == pytest.approx(1.0)
    swapped = Placement.from_physical_to_logical(torch.tensor([[0, 2, 1, 3]]), 4)
    assert balance_ratio(loads, swapped, 2) == pytest.approx(1.5)


def test_equal_loads_tie_break_goes_to_the_higher_index():
    # Loads 5 and 5: the +e * 1e-4 tie-break makes expert 1 the strict maximum, so only its replica
    # lowers the per-step maximum per-replica load.
    placement = rebalance(torch.tensor([[[5.0, 5.0]]]), 1, 3)
    assert placement.replica_counts.tolist() == [[1, 2]]


def test_balance_ratio_of_uniform_load_on_identity_is_one_and_skew_is_above():
    uniform = torch.full((5, 2, 8), 10.0)
    assert balance_ratio(uniform, identity_placement(2, 8, 4), 4) == pytest.approx(1.0)
    skewed = uniform.clone()
    skewed[:, :, 0] = 50.0  # rank 0 carries 60 of 120 per step: max 60 / mean 30
    assert balance_ratio(skewed, identity_placement(2, 8, 4), 4) == pytest.approx(2.0)
    assert balance_ratio(torch.zeros(3, 2, 8), identity_placement(2, 8, 4), 4) == 1.0


def test_balance_ratio_splits_a_token_over_replicas():
    loads = torch.tensor([[[8.0, 0.0]]])
    both_ranks = Placement.from_physical_to_logical(torch.tensor([[0, 0, 1, 1]]), 2)  # cap 2: e0 on 0, 0
    assert balance_ratio(loads, both_ranks, 2) == pytest.approx(2.0)
    spread = Placement.from_physical_to_logical(torch.tensor([[0, 1, 0, 1]]), 2)  # e0 on ranks 0 and 1
    assert balance_ratio(loads, spread, 2) == pytest.approx(1.0)


@pytest.mark.parametrize(
    ("tokens", "ranks", "physical", "message"),
    [
        (torch.ones(2, 1, 8), 2, 6, "must be an integer >= the number of logical experts"),
        (torch.ones(2, 1, 8), 3, 10, "must be divisible by num_ranks"),
        (-torch.ones(2, 1, 8), 2, 8, "non-negative"),
        (torch.ones(2, 8), 2, 8, "must be \\[steps, layers, experts\\]"),
        (torch.ones(2, 1, 1, 8), 2, 8, "must be \\[steps, layers, experts\\]"),
        (torch.ones(0, 1, 8), 2, 8, "at least one step"),
        (torch.full((2, 1, 8), float("nan")), 2, 8, "finite"),
        (torch.ones(2, 1, 8), 0, 8, "num_ranks must be a positive integer"),
        (torch.ones(2, 1, 8, dtype=torch.bool), 2, 8, "integer or floating point"),
        ([[[1.0]]], 1, 1, "must be a torch.Tensor"),
    ],
)
def test_bad_inputs_raise_clear_value_errors(tokens, ranks, physical, message):
    with pytest.raises(ValueError, match=message):
        rebalance(tokens, ranks, physical)


def test_balance_ratio_rejects_tokens_of_another_shape():
    with pytest.raises(ValueError, match="do not match"):
        balance_ratio(torch.ones(2, 3, 8), identity_placement(2, 8, 2), 2)


def test_swap_refinement_never_worse_than_the_greedy_placement_and_better_somewhere():
    """refine_by_swaps only applies swaps that lower the objective: on Zipf loads the placement with it is never
    worse than greedy placement alone, and on some it is strictly better."""
    from deepserve.eplb import place, refine_by_swaps, replicate, validate

    gains = []
    for seed in range(4):
        tokens = zipf_loads(1.0 + 0.1 * seed, steps=20, layers=2, experts=32, seed=seed)
        counts = validate(tokens, 4, 32).permute(1, 0, 2).contiguous()
        replicas, replica_counts = replicate(counts, 0)
        greedy = place(counts, replicas, replica_counts, 4)
        refined = refine_by_swaps(counts, greedy, replica_counts, 4)
        assert sorted(refined[0].tolist()) == sorted(greedy[0].tolist())      # a permutation of the same replicas
        before = balance_ratio(tokens, Placement.from_physical_to_logical(greedy, 32), 4)
        after = balance_ratio(tokens, Placement.from_physical_to_logical(refined, 32), 4)
        assert after <= before + 1e-12
        gains.append(before - after)
    assert max(gains) > 0
