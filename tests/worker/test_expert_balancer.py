"""The expert balancer (worker/expert_balancer.py) on one rank: the policy runs in the background and its placement
is applied exactly `apply_delay` steps after the window was summed (the step every rank of an EP group agrees on),
the hot expert gets the redundant slots, and the layer computes the same output with the new placement."""

from __future__ import annotations

import torch

from deepserve.layers.expert_parallel import enable_expert_parallel
from deepserve.layers.rank_group import RankGroup
from deepserve.worker.expert_balancer import ExpertBalancer
from tests.layers.test_expert_parallel import E, H, _layer


def test_placement_switches_at_the_agreed_step_and_outputs_stay():
    torch.set_num_threads(1)
    layer = _layer(shared=False)
    x = torch.randn(7, H)
    want = layer(x)
    # Two "ranks" worth of slots held by one: the EP group of size 1 still spreads P = E + 2 physical slots.
    enable_expert_parallel([layer], RankGroup(), RankGroup(), E + 2)
    balancer = ExpertBalancer([layer], RankGroup(), 1, interval=8, window=8)
    assert (balancer.next_rebalance, balancer.apply_delay) == (2, 4)
    before = layer.expert_parallel.physical_to_logical.clone()
    hot = torch.zeros(E, dtype=torch.int64)
    hot[3] = 50                                  # expert 3 is hot: the policy gives it the redundant slots
    maps = []
    for _ in range(8):
        layer.expert_load.copy_(hot + 1)
        balancer.end_step()
        maps.append(layer.expert_parallel.physical_to_logical.clone())
    # Window summed at step 2; placement applied at step 2 + 4 = 6, and not before.
    assert all(torch.equal(m, before) for m in maps[:5])
    assert not torch.equal(maps[5], before) and int((maps[5] == 3).sum()) == 3
    assert balancer.num_rebalances == 1 and balancer.moe_lb is not None
    assert balancer.moe_lb == 1.0          # one rank: its load is the mean
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
