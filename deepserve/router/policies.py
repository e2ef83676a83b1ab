"""Routing policies: given the eligible replicas and a request, which replica serves it, and why.

- round_robin: each replica in turn.
- least_load: fewest requests in flight (then fewest tokens); ties rotate, so an idle fleet is not one replica.
- power_of_two: two replicas at random, the less loaded one (cheap, and no herd on the one least-loaded
  replica when loads are stale).
- cache_aware: the replica that was sent the longest prefix of the request's text (prefix_tree.py), as
  sgl-router does, with the fixes its users asked for (field.md §B.6, §E1): on a miss the least loaded
  replica, not the one with the smallest tree (which ignored load and spiralled); when loads are imbalanced,
  the best match among the replicas within `balance_abs` of the least loaded, not plain least load (which
  threw away affinity); ties on match broken by load.

A policy sees only eligible replicas (healthy, not removed, breaker closed or trial) and at least one.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass

from deepserve.router.config import CacheAwareSettings, RouterConfig
from deepserve.router.prefix_tree import PrefixTree
from deepserve.router.replica import Replica
from deepserve.router.routing_key import RoutedRequest


@dataclass(frozen=True)
class Decision:
    replica: Replica
    reason: str                 # the policy's name, or cache_hit | cache_miss | imbalanced_hit | imbalanced_miss
    matched_chars: int = 0      # cache_aware: the chosen replica's match


def load_key(replica: Replica) -> tuple[float, int]:
    return replica.load, replica.in_flight_tokens


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, replicas: Sequence[Replica], request: RoutedRequest) -> Decision:
        ordered = sorted(replicas, key=lambda r: r.url)
        return Decision(ordered[next(self._turn) % len(ordered)], self.name)

    def forget(self, url: str) -> None:
        pass

    def maintain(self) -> None:
        pass


class LeastLoad:
    name = "least_load"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, replicas: Sequence[Replica], request: RoutedRequest) -> Decision:
        return Decision(self.least_loaded(replicas), self.name)

    def least_loaded(self, replicas: Sequence[Replica]) -> Replica:
        best = min(load_key(r) for r in replicas)
        tied = sorted((r for r in replicas if load_key(r) == best), key=lambda r: r.url)
        return tied[next(self._turn) % len(tied)]

    def forget(self, url: str) -> None:
        pass

    def maintain(self) -> None:
        pass


class PowerOfTwo:
    name = "power_of_two"

    def __init__(self, seed: int | None = None) -> None:
        self._random = random.Random(seed)

    def choose(self, replicas: Sequence[Replica], request: RoutedRequest) -> Decision:
        if len(replicas) == 1:
            return Decision(replicas[0], self.name)
        first, second = self._random.sample(list(replicas), 2)
        return Decision(min(first, second, key=load_key), self.name)

    def forget(self, url: str) -> None:
        pass

    def maintain(self) -> None:
        pass


class CacheAware:
    name = "cache_aware"

    def __init__(self, settings: CacheAwareSettings | None = None, tree: PrefixTree | None = None) -> None:
        self.settings = settings or CacheAwareSettings()
        self.tree = tree or PrefixTree()
        self._least_load = LeastLoad()

    def choose(self, replicas: Sequence[Replica], request: RoutedRequest) -> Decision:
        matches = self.tree.match(request.text)
        decision = self._decide(replicas, request, matches)
        # Recorded at dispatch (not on success): the next request of a burst must already see it.
        self.tree.insert(request.text, decision.replica.url)
        return decision

    def _decide(self, replicas: Sequence[Replica], request: RoutedRequest, matches: dict[str, int]) -> Decision:
        imbalanced = self.is_imbalanced(replicas)
        candidates = self._affinity_window(replicas) if imbalanced else list(replicas)
        kind = "imbalanced" if imbalanced else "cache"
        best = max(matches.get(r.url, 0) for r in candidates)
        if best > 0 and best >= self.settings.cache_threshold * len(request.text):
            holders = [r for r in candidates if matches.get(r.url, 0) == best]
            return Decision(self._least_load.least_loaded(holders), f"{kind}_hit", best)
        chosen = self._least_load.least_loaded(candidates)
        return Decision(chosen, f"{kind}_miss", matches.get(chosen.url, 0))

    def _affinity_window(self, replicas: Sequence[Replica]) -> list[Replica]:
        """The replicas within balance_abs of the least loaded: where an imbalanced fleet may still send by match."""
        floor = min(r.load for r in replicas)
        return [r for r in replicas if r.load <= floor + self.settings.balance_abs]

    def is_imbalanced(self, replicas: Sequence[Replica]) -> bool:
        loads = [r.load for r in replicas]
        low, high = min(loads), max(loads)
        return high - low > self.settings.balance_abs and high > self.settings.balance_rel * low

    def forget(self, url: str) -> None:
        self.tree.remove_tenant(url)

    def maintain(self) -> None:
        self.tree.evict(self.settings.max_chars_per_replica)


Policy = RoundRobin | LeastLoad | PowerOfTwo | CacheAware


def make_policy(config: RouterConfig) -> Policy:
    if config.policy == "cache_aware":
        return CacheAware(config.cache_aware)
    if config.policy == "least_load":
        return LeastLoad()
    if config.policy == "power_of_two":
        return PowerOfTwo(config.seed)
    return RoundRobin()
