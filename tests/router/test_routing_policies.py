"""Policy decisions on hand-built replicas: who gets the request, and why."""

from __future__ import annotations

from collections import Counter

import pytest

from deepserve.router.circuit_breaker import CircuitBreaker
from deepserve.router.config import CacheAwareSettings, RouterConfig
from deepserve.router.load_report import LoadReport
from deepserve.router.policies import CacheAware, LeastLoad, PowerOfTwo, RoundRobin, make_policy
from deepserve.router.replica import Replica
from deepserve.router.routing_key import RoutedRequest


def replicas(*loads: int) -> list[Replica]:
    out = []
    for i, load in enumerate(loads):
        replica = Replica(f"http://r{i}:1", CircuitBreaker())
        replica.healthy = True
        replica.in_flight = load
        out.append(replica)
    return out


def req(text: str) -> RoutedRequest:
    return RoutedRequest("/v1/completions", b"", text=text)


def test_round_robin_takes_turns():
    fleet = replicas(0, 0, 0)
    policy = RoundRobin()
    assert [policy.choose(fleet, req("x")).replica.url for _ in range(6)] == [r.url for r in fleet] * 2


def test_least_load_picks_the_least_loaded_and_rotates_ties():
    fleet = replicas(3, 1, 1)
    policy = LeastLoad()
    chosen = [policy.choose(fleet, req("x")).replica.url for _ in range(4)]
    assert set(chosen) == {fleet[1].url, fleet[2].url} and chosen[0] != chosen[1]


def test_least_load_breaks_request_ties_by_tokens():
    fleet = replicas(1, 1)
    fleet[0].in_flight_tokens = 5000
    assert LeastLoad().choose(fleet, req("x")).replica is fleet[1]


def test_load_is_the_larger_of_own_count_and_the_replicas_report():
    fleet = replicas(2, 2)
    fleet[0].report = LoadReport(running=6, waiting=3)      # traffic from elsewhere
    assert fleet[0].load == 9 and fleet[1].load == 2
    assert LeastLoad().choose(fleet, req("x")).replica is fleet[1]


def test_power_of_two_never_picks_the_most_loaded_of_three():
    fleet = replicas(0, 5, 9)
    policy = PowerOfTwo(seed=1)
    counts = Counter(policy.choose(fleet, req("x")).replica.url for _ in range(300))
    assert counts[fleet[2].url] == 0 and counts[fleet[0].url] > counts[fleet[1].url] > 0


def test_cache_aware_sends_a_shared_prefix_back_to_its_replica():
    fleet = replicas(0, 0, 0)
    policy = CacheAware()
    system = "You are a helpful assistant who answers in French. " * 4
    first = policy.choose(fleet, req(system + "user 1: bonjour"))
    assert first.reason == "cache_miss"
    for i in range(2, 6):
        decision = policy.choose(fleet, req(system + f"user {i}: salut"))
        assert decision.replica is first.replica and decision.reason == "cache_hit"
        assert decision.matched_chars >= len(system)


def test_cache_aware_miss_goes_to_the_least_loaded_not_the_smallest_tree():
    # sgl-router's death spiral: on a miss it chose the smallest tree, whatever its load.
    fleet = replicas(8, 0)
    policy = CacheAware(CacheAwareSettings(balance_abs=32))
    policy.tree.insert("a long history on replica 1 " * 20, fleet[1].url)      # r1: big tree, idle
    assert policy.choose(fleet, req("a brand new prompt")).replica is fleet[1]


def test_cache_aware_ties_on_match_go_to_the_less_loaded():
    fleet = replicas(4, 1)
    policy = CacheAware()
    for replica in fleet:
        policy.tree.insert("common prefix of everything", replica.url)
    assert policy.choose(fleet, req("common prefix of everything, then more")).replica is fleet[1]


def test_cache_aware_below_the_threshold_is_a_miss():
    fleet = replicas(0, 1)
    policy = CacheAware(CacheAwareSettings(cache_threshold=0.5))
    policy.tree.insert("abc", fleet[1].url)
    decision = policy.choose(fleet, req("abc" + "x" * 10))      # 3 of 13 matched
    assert decision.reason == "cache_miss" and decision.replica is fleet[0]


def test_imbalance_needs_both_thresholds():
    policy = CacheAware(CacheAwareSettings(balance_abs=4, balance_rel=1.5))
    assert policy.is_imbalanced(replicas(10, 5))            # 5 > 4 and 10 > 7.5
    assert not policy.is_imbalanced(replicas(10, 6))        # 4 is not > 4
    assert not policy.is_imbalanced(replicas(105, 100))     # 105 is not > 150


def test_imbalanced_keeps_affinity_within_the_window():
    fleet = replicas(20, 2, 0)                   # r0 overloaded; r1 within balance_abs of the least loaded
    policy = CacheAware(CacheAwareSettings(balance_abs=4, balance_rel=1.5))
    prompt = "shared prefix " * 10
    for replica in fleet[:2]:
        policy.tree.insert(prompt, replica.url)
    decision = policy.choose(fleet, req(prompt + "q"))
    assert decision.reason == "imbalanced_hit" and decision.replica is fleet[1]   # not r0, not the cold r2
    only_hot = replicas(20, 0)
    policy.tree.insert("hot only " * 10, only_hot[0].url)
    decision = policy.choose(only_hot, req("hot only " * 10))
    assert decision.reason == "imbalanced_miss" and decision.replica is only_hot[1]


def test_one_slow_replica_does_not_take_all_the_traffic():
    # A replica that stops finishing its requests piles up in-flight load; past the imbalance threshold the
    # others take the requests, even those whose prefix only the slow one holds (field.md §B.6a).
    slow, fast = replicas(0, 0)
    policy = CacheAware(CacheAwareSettings(balance_abs=8, balance_rel=1.5))
    prompt = "the one shared system prompt " * 5
    sent = Counter()
    for i in range(100):
        chosen = policy.choose([slow, fast], req(prompt + str(i))).replica
        sent[chosen.url] += 1
        if chosen is slow:
            slow.in_flight += 1           # never finishes; the fast one finishes at once
    assert slow.in_flight <= 8 + 1
    assert sent[fast.url] >= 100 - 9


def test_removed_replica_is_forgotten_by_the_tree():
    fleet = replicas(0, 0)
    policy = CacheAware()
    policy.tree.insert("prefix", fleet[0].url)
    policy.forget(fleet[0].url)
    assert policy.tree.match("prefix") == {}


@pytest.mark.parametrize("name, cls", [("cache_aware", CacheAware), ("least_load", LeastLoad),
                                       ("power_of_two", PowerOfTwo), ("round_robin", RoundRobin)])
def test_make_policy(name, cls):
    assert isinstance(make_policy(RouterConfig(replicas=["http://a:1"], policy=name)), cls)
