"""Expert-parallel load balancing in a running engine (deepinfer.md section 7): count, rebalance, move weights.

After every step each MoE layer's per-expert counters (`FusedMoE.expert_load`: tokens the gate routed to each
logical expert on this rank) go into a window of the last `window` steps, and are reset. Every `interval` steps
(the first time after interval / 4), every rank of the EP group, at the same step:
  1. sums the window over the EP group (tensor-parallel peers count the same tokens, so the sum is divided by tp);
  2. runs the policy, `deepserve.eplb.rebalance(tokens[steps, layers, experts], ep, physical)`, a pure function, so
     every rank computes the same placement;
  3. moves expert weights to where the new map puts them (layers/expert_parallel.py, point-to-point between the
     EP ranks) and switches the layers' maps.
Step 2 runs in a background thread (the policy takes up to seconds for a full-size model, and the engine keeps
stepping meanwhile); every rank applies its result, step 3, at the same later step, `apply_delay` steps after the
window was summed, waiting for its thread there if it is not done. The weights move between two steps, so requests
in flight continue with the new placement (their tokens are the same: a replica computes the same expert). `moe_lb` (sum over steps of the busiest rank's load / of the mean
rank's, 1.0 = even) is recomputed from the summed window every METRIC_INTERVAL steps and at each rebalance.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from deepserve.eplb import Placement, balance_ratio, rebalance
from deepserve.layers.expert_parallel import move_experts
from deepserve.layers.moe import expert_load, reset_expert_load
from deepserve.layers.rank_group import RankGroup

logger = logging.getLogger(__name__)

METRIC_INTERVAL = 128      # steps between moe_lb updates (DeepInfer's)
APPLY_DELAY = 32           # steps between summing the window and applying the policy's placement (at most)


class ExpertBalancer:
    def __init__(self, moe_layers: list, ep: RankGroup, tp_size: int, interval: int, window: int) -> None:
        self.layers = moe_layers
        self.ep, self.tp_size = ep, tp_size
        self.interval, self.window = interval, deque(maxlen=window)
        self.num_experts = moe_layers[0].num_experts
        self.num_physical = moe_layers[0].expert_parallel.num_physical
        self.steps = 0
        self.next_rebalance = max(interval // 4, 1) if interval else None
        self.num_rebalances = 0
        self.moe_lb: float | None = None
        self.last_rebalance_seconds: float | None = None
        # Short intervals (tests) apply sooner: never later than half an interval after the window was summed.
        self.apply_delay = min(APPLY_DELAY, max(interval // 2, 1)) if interval else APPLY_DELAY
        self._policy = ThreadPoolExecutor(1, thread_name_prefix="deepserve-eplb") if interval else None
        self._pending: tuple[int, torch.Tensor, Future] | None = None      # (apply at step, tokens, placement)

    def end_step(self) -> None:
        """Called by every rank after every step (the rank loop keeps them in lockstep)."""
        counts = expert_load(self.layers).cpu()
        reset_expert_load(self.layers)
        self.window.append(counts)
        self.steps += 1
        if self._pending is not None and self.steps >= self._pending[0]:
            self._apply()
        elif self.next_rebalance is not None and self.steps >= self.next_rebalance and self._pending is None:
            self._start_policy()
            self.next_rebalance += self.interval
        elif self.steps % METRIC_INTERVAL == 0:
            self.moe_lb = balance_ratio(self.window_tokens(), self.placement(), self.ep.size)

    def window_tokens(self) -> torch.Tensor:
        """[steps, layers, experts] tokens of the whole EP group over the window (a collective)."""
        local = torch.stack(list(self.window)).to(torch.float64)
        return self.ep.all_reduce(local) / self.tp_size

    def placement(self) -> Placement:
        maps = torch.stack([layer.expert_parallel.physical_to_logical.cpu() for layer in self.layers])
        return Placement.from_physical_to_logical(maps, self.num_experts)

    def rebalance(self) -> None:
        """Sum the window, run the policy and move the experts now (all of it in this step)."""
        self._start_policy()
        self._apply()

    def _start_policy(self) -> None:
        tokens = self.window_tokens()
        future = self._policy.submit(rebalance, tokens, self.ep.size, self.num_physical)
        self._pending = (self.steps + self.apply_delay, tokens, future)

    def _apply(self) -> None:
        _, tokens, future = self._pending
        self._pending = None
        started = time.perf_counter()
        new = future.result()                   # every rank waits here, at the same step, if its policy still runs
        waited = time.perf_counter() - started
        before = balance_ratio(tokens, self.placement(), self.ep.size)
        for layer, p2l in zip(self.layers, new.physical_to_logical):
            move_experts(layer, p2l)
        self.moe_lb = balance_ratio(tokens, new, self.ep.size)
        self.num_rebalances += 1
        self.last_rebalance_seconds = time.perf_counter() - started
        logger.info("EPLB: rebalanced %d MoE layers over %d ranks (waited %.3f s for the policy, moved in %.3f s); "
                    "balance %.3f -> %.3f over the last %d steps", len(self.layers), self.ep.size, waited,
                    self.last_rebalance_seconds - waited, before, self.moe_lb, len(self.window))
