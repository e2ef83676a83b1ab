"""Three real `deepserve serve` replicas of the default model (CPU, one thread each) behind the router, on the
shared-prefix workload of `deepserve bench serve` (8 system prompts x 4 users, shuffled): cache_aware sends
each system prompt to one replica, so the replicas' prefix caches hit more and time to first token is lower
than with round_robin, which computes each prompt once per replica; and no replica gets more than 2x its
fair share.

The workload is driven by the benchmark's own load generator (deepserve/bench/serve.py), the hit rate read
from the replicas' /metrics. Each policy gets system prompts of its own (another seed), so neither finds
the other's prefixes cached. About 30 s on 2 idle cores (three model loads, 2 x 32 requests), ~50 s beside
2 busy processes: it runs by default."""

from __future__ import annotations

import argparse
import asyncio
import statistics

import httpx
import pytest
from router_harness import MODEL, serve_processes, thread_router, wait_until

from deepserve.bench.serve import add_bench_serve_args, run_load, shared_prefix_prompts

GROUPS, USERS = 8, 4
PREFIX_WORDS = 256          # a system prompt of ~260 tokens: ~0.5 s to prefill on one thread, ~0.1 s when cached
BENCH_FLAGS = ["--endpoint", "chat", "--output-len", "2", "--input-len", "12"]
CONCURRENCY = 2             # two requests in flight: 2 cores, and a policy still sees load


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with serve_processes(tmp_path_factory.mktemp("replicas"), 3, "--max-model-len", "512", threads=1) as procs:
        yield procs


def prefix_counters(servers) -> tuple[float, float]:
    hits = sum(s.metric("deepserve:prefix_cache_hits_total") for s in servers)
    return hits, sum(s.metric("deepserve:prefix_cache_queries_total") for s in servers)


def run_policy(servers, policy: str, seed: int) -> dict:
    """The workload through a fresh router of `policy`: hit rate (replicas' metrics), TTFTs, requests per replica."""
    args = argparse.ArgumentParser()
    add_bench_serve_args(args)
    args = args.parse_args(BENCH_FLAGS)
    prompts = shared_prefix_prompts(GROUPS, PREFIX_WORDS, GROUPS * USERS, 12, seed)
    with thread_router([s.url for s in servers], policy=policy, health_interval_s=0.5, health_timeout_s=5.0,
                       read_timeout_s=120.0) as router:
        wait_until(lambda: len(router.state.replicas.eligible()) == 3, 15, what="three replicas eligible")
        hits, queries = prefix_counters(servers)
        results = asyncio.run(_drive(router.base_url, args, prompts))
        hits, queries = (after - before for after, before in zip(prefix_counters(servers), (hits, queries)))
        served = {s.url: router.metric("deepserve:router_requests_total", replica=s.url, outcome="ok")
                  for s in servers}
        cache_hits = router.metric("deepserve:router_routing_decisions_total", policy=policy, reason="cache_hit")
    assert [r.error for r in results if not r.ok] == []
    return {"hit_rate": hits / queries, "mean_ttft_s": statistics.fmean(r.ttft_s for r in results),
            "served": served, "cache_hit_decisions": cache_hits,
            "answers_hit_rate": sum(r.cached_tokens for r in results) / sum(r.prompt_tokens for r in results)}


async def _drive(base_url: str, args: argparse.Namespace, prompts) -> list:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        return await run_load(client, args, MODEL, prompts, CONCURRENCY)


@pytest.mark.slow   # ~60 s of real replicas on 2 cores; the policy's decisions are unit-tested in test_routing_policies.py
def test_cache_aware_beats_round_robin_on_a_shared_prefix_workload(servers):
    rr = run_policy(servers, "round_robin", seed=1)
    ca = run_policy(servers, "cache_aware", seed=2)
    print(f"round_robin {rr}\ncache_aware {ca}")
    total = GROUPS * USERS
    # Each system prompt computed once, on one replica; its 3 later users routed to it by their match.
    assert ca["cache_hit_decisions"] == total - GROUPS
    assert ca["hit_rate"] > rr["hit_rate"] + 0.2, (ca["hit_rate"], rr["hit_rate"])
    assert ca["mean_ttft_s"] < rr["mean_ttft_s"], (ca["mean_ttft_s"], rr["mean_ttft_s"])
    for result in (rr, ca):
        # The benchmark's own reading (the answers' cached_tokens) tells the same as the replicas' counters.
        assert result["answers_hit_rate"] == pytest.approx(result["hit_rate"], abs=0.03)
        assert sum(result["served"].values()) == total
        assert max(result["served"].values()) <= 2 * total / len(servers), result["served"]
