"""deepserve/parallel/groups.py: the TP / DP / EP layout on 4 gloo processes, and clear errors for sizes that make
no layout."""

from __future__ import annotations

import pytest
import torch

from deepserve.parallel.groups import check_sizes
from tests.parallel.gloo_harness import make_groups, run_ranks


def _layout(rank: int, world: int, tp: int, ep: int):
    ctx = make_groups(rank, world, tp, ep)
    # Each group's sum of global ranks proves its members really talk to each other.
    sums = {name: int(getattr(ctx, name).all_reduce(torch.tensor([rank])).item()) for name in ("tp", "dp", "ep", "world")}
    return {name: getattr(ctx, name).ranks for name in ("tp", "dp", "ep")}, sums


def test_four_ranks_tp2_ep4_layout():
    results = run_ranks(_layout, 4, 2, 4)
    groups = [r[0] for r in results]
    assert groups[0] == {"tp": (0, 1), "dp": (0, 2), "ep": (0, 1, 2, 3)}
    assert groups[3] == {"tp": (2, 3), "dp": (1, 3), "ep": (0, 1, 2, 3)}
    for rank, (ranks, sums) in enumerate(results):
        assert sums == {name: sum(ranks[name]) for name in ("tp", "dp", "ep")} | {"world": 6}


@pytest.mark.parametrize("world,tp,ep,field", [(4, 3, 1, "tensor-parallel"), (4, 1, 3, "expert_parallel_size"),
                                               (4, 2, 1, None), (4, 4, 2, "multiple of tensor_parallel_size"),
                                               (2, 0, 1, "tensor_parallel_size")])
def test_sizes_that_make_no_layout_are_refused(world, tp, ep, field):
    if field is None:
        check_sizes(world, tp, ep)
        return
    with pytest.raises(ValueError, match=field):
        check_sizes(world, tp, ep)
