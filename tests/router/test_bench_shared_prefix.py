"""`deepserve bench serve --shared-prefix-groups`: the workload of the router's benchmark (G system prompts, each
request one of them plus its own question), how it is sent (system message on chat, the prompt's start on
completions), and the prefix-cache hit rate read from the answers' usage. Against a fake replica process."""

from __future__ import annotations

import argparse
import asyncio
import collections
import json

import httpx
import pytest
from router_harness import fake_replicas

from deepserve.bench.serve import (
    add_bench_serve_args,
    run_from_args,
    run_load,
    shared_prefix_prompts,
    summarize,
    workload_prompts,
)


def bench_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_serve_args(parser)
    return parser.parse_args(list(flags))


@pytest.fixture(scope="module")
def replica():
    with fake_replicas(1) as replicas:
        yield replicas[0]


def test_prompts_spread_evenly_over_distinct_prefixes_in_a_shuffled_order():
    prompts = shared_prefix_prompts(groups=8, prefix_len=50, num_prompts=20, input_len=6, seed=3)
    per_group = collections.Counter(p.system for p in prompts)
    assert len(per_group) == 8 and sorted(per_group.values()) == [2] * 4 + [3] * 4
    assert all(len(p.system.split()) == 50 and len(p.text.split()) == 6 for p in prompts)
    assert len({p.text for p in prompts}) == 20                       # every user asks something of their own
    # Shuffled: not the groups in turn (which a round-robin router would map onto replicas by accident).
    assert not all(prompts[i].system == prompts[i % 8].system for i in range(20))
    assert shared_prefix_prompts(8, 50, 20, 6, seed=3) == prompts
    assert shared_prefix_prompts(8, 50, 20, 6, seed=4)[0].system not in per_group


def test_workload_prompts_without_groups_are_the_plain_random_prompts():
    args = bench_args("--num-prompts", "3", "--input-len", "5")
    prompts = workload_prompts(args)
    assert len(prompts) == 3 and all(p.system == "" and len(p.text.split()) == 5 for p in prompts)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_the_prefix_is_sent_as_the_system_message_or_the_prompts_start(replica, endpoint):
    replica.control(reset=True, cached_tokens=4)
    args = bench_args("--endpoint", endpoint, "--shared-prefix-groups", "2", "--shared-prefix-len", "5",
                      "--num-prompts", "4", "--input-len", "3", "--output-len", "2")
    prompts = workload_prompts(args)
    results = asyncio.run(_drive(replica.url, args, prompts, concurrency=2))
    assert all(r.ok for r in results)
    seen = replica.seen()
    assert len(seen["prompts"]) == 4
    for prompt in prompts:
        if endpoint == "chat":
            expected = [{"role": "system", "content": prompt.system}, {"role": "user", "content": prompt.text}]
            assert repr(expected) in seen["prompts"]
        else:
            assert f"{prompt.system}\n\n{prompt.text}" in seen["prompts"]
    summary = summarize(results, 1.0, {}, {})
    assert summary["total_cached_tokens"] == 4 * 4 and summary["prefix_cache_hit_rate"] == pytest.approx(0.4)


def test_the_cli_records_the_workload_and_warms_up_outside_it(replica, tmp_path):
    replica.control(reset=True, cached_tokens=0)
    out = tmp_path / "bench.json"
    argv = ["--base-url", replica.url, "--model", "fake", "--shared-prefix-groups", "3", "--shared-prefix-len", "8",
            "--num-prompts", "6", "--input-len", "2", "--output-len", "3", "--output-json", str(out)]
    assert run_from_args(bench_args(*argv), ["bench", "serve", *argv]) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["shared_prefix_groups"] == 3 and run["shared_prefix_len"] == 8 and run["completed"] == 6
    assert run["prefix_cache_hit_rate"] == 0.0
    systems = {p.system for p in workload_prompts(bench_args(*argv))}
    warmup = replica.seen()["prompts"][0]                  # the first request is the unmeasured warm-up
    assert len(replica.seen()["prompts"]) == 7 and not any(warmup.startswith(s) for s in systems)


def test_a_shared_prefix_run_is_validated():
    with pytest.raises(ValueError, match="shared-prefix-len"):
        run_from_args(bench_args("--shared-prefix-groups", "2", "--shared-prefix-len", "0"), [])
    with pytest.raises(ValueError, match="replaces --dataset"):
        run_from_args(bench_args("--shared-prefix-groups", "2", "--dataset", "x.json"), [])


async def _drive(url: str, args: argparse.Namespace, prompts, concurrency: int):
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        return await run_load(client, args, "fake", prompts, concurrency)
