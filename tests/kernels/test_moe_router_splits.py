"""The MoE router GEMM's split count (kernels/moe_routing.py `router_splits`) forced by DEEPSERVE_ROUTER_SPLITS, the
A/B switch: rounded up to a power of two (`fused_route` compiles a kernel per count), held to 16 and to the K steps;
0 keeps the rule. Pure arithmetic: a CPU device (the rule counts 8 SMs there), no kernel runs."""

import torch

from deepserve.kernels import moe_routing
from deepserve.kernels.moe_routing import MMA_SPLIT_TILES, router_splits

CPU = torch.device("cpu")


def test_forced_counts_are_powers_of_two_within_the_limits():
    # V2-Lite's gate at 256 tokens: 2048 wide, 32 K steps of 64
    assert [router_splits(256, 64, 2048, CPU, MMA_SPLIT_TILES, forced=n) for n in (1, 2, 3, 4, 5, 16, 64)] == \
        [1, 2, 4, 4, 8, 16, 16]
    assert router_splits(256, 64, 96, CPU, MMA_SPLIT_TILES, forced=8) == 2      # 2 K steps


def test_zero_keeps_the_rule(monkeypatch):
    # 16 tiles of 16 tokens x 64 experts already give 8 SMs two programs each: no split; 17 tokens (2 tiles) take 8
    assert router_splits(256, 64, 2048, CPU, MMA_SPLIT_TILES, forced=0) == 1
    assert router_splits(17, 64, 2048, CPU, MMA_SPLIT_TILES, forced=0) == 8
    monkeypatch.setattr(moe_routing, "FORCED_SPLITS", 0)           # the switch unset: the rule by default
    assert router_splits(17, 64, 2048, CPU, MMA_SPLIT_TILES) == 8
    monkeypatch.setattr(moe_routing, "FORCED_SPLITS", 2)           # set: forced by default
    assert router_splits(17, 64, 2048, CPU, MMA_SPLIT_TILES) == 2
