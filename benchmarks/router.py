"""The router on a shared-prefix workload, per policy, and the latency the router itself adds.

Per policy (cache_aware, least_load, power_of_two, round_robin): `--replicas` fresh `deepserve serve` replicas of
the default model (empty prefix caches, one CPU thread each on 2 cores) behind a `deepserve router --policy P`
process, loaded by `deepserve bench serve --endpoint chat --shared-prefix-groups G` (G system prompts, each
request one of them plus its own question, shuffled; the same prompts for every policy). Recorded: the prefix
hit rate (the replicas' /metrics: prefix_cache_hits / prefix_cache_queries, in tokens, over the run; and the
`cached_tokens` the answers report), TTFT mean / p50 / p99, request and output-token throughput, and the
requests each replica served (the router's /metrics; the benchmark's one warm-up request included).

Two scenarios: the default KV cache (room for every prefix on every replica: a policy that spreads a prefix
only pays its first prefill once per replica), and a KV cache too small for all G prefixes on one replica
(`--tight-kv-bytes`), where spreading them makes each replica evict what it will need again.

Router overhead: one replica, the same tiny request (1 token) sent directly and through the router in turns
(pairs, so a noisy neighbour slows both sides alike); the added latency is the median of the pairs'
differences, plain and streamed.

Run:  python benchmarks/router.py [--users 16] [--max-concurrency 4] [--overhead-pairs 150]
Writes benchmarks/router.json (with the commands) and benchmarks/router.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from deepserve.bench.serve import percentile
from deepserve.bench.throughput import machine_info, write_json

POLICIES = ("cache_aware", "least_load", "power_of_two", "round_robin")
NOISE_NOTE = ("The load averages include this benchmark's own processes (the replicas, the router and the client "
              "keep ~2 of the 2 cores busy), and other engineers' test runs share the VM at times: latencies and "
              "throughputs moved by up to ~30% between two runs; hit rates and shares barely moved.")
MODEL = "SmolLM2-135M-Instruct"


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    ap.add_argument("--groups", type=int, default=8, help="shared system prompts")
    ap.add_argument("--users", type=int, default=16, help="requests per system prompt")
    ap.add_argument("--prefix-len", type=int, default=256, help="words of each system prompt")
    ap.add_argument("--input-len", type=int, default=16, help="words of each user's question")
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--max-concurrency", type=int, default=4)
    ap.add_argument("--overhead-pairs", type=int, default=150)
    ap.add_argument("--tight-kv-bytes", type=int, default=80_000_000,
                    help="KV cache per replica of the second scenario (80 MB: 108 blocks of 16 tokens; 0: skip it)")
    ap.add_argument("--output", default="benchmarks/router.json")
    return ap.parse_args(argv)


# --- processes ------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Process:
    """A `deepserve` command on a free loopback port, logging to a file; stop() sends SIGTERM (it drains)."""

    def __init__(self, log_dir: str, name: str, args: list[str], threads: int | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in os.environ.items() if k != "DEEPSERVE_API_KEY"}
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        self.log_path = os.path.join(log_dir, f"{name}.log")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "deepserve.cli", *args, "--port", str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.url} exited: {open(self.log_path).read()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"{self.url} not healthy after {timeout_s} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_replicas(log_dir: str, n: int, tag: str, kv_bytes: int | None = None) -> list[Process]:
    """n replicas loaded in parallel, each warmed by one request (the first request of a process pays one-time
    costs that would land in the first measured TTFTs)."""
    threads = max(1, (os.cpu_count() or 1) // n)     # n engines on the cores, not n x cores threads spinning
    flags = ["serve", "--max-model-len", "1024", "--seed", "0"]
    flags += ["--kv-cache-memory-bytes", str(kv_bytes)] if kv_bytes else []
    replicas = [Process(log_dir, f"{tag}-replica{i}", flags, threads) for i in range(n)]
    for replica in replicas:
        replica.wait_healthy()
    for replica in replicas:
        body = {"model": MODEL, "prompt": "Warm up", "max_tokens": 2}
        httpx.post(replica.url + "/v1/completions", json=body, timeout=120).raise_for_status()
    return replicas


def start_router(log_dir: str, replicas: list[Process], policy: str) -> Process:
    args = ["router", "--policy", policy, "--health-interval", "1", "--health-timeout", "5"]
    for replica in replicas:
        args += ["--replica", replica.url]
    router = Process(log_dir, f"router-{policy}", args)
    router.wait_healthy(60)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and eligible(router) < len(replicas):
        time.sleep(0.2)
    return router


def eligible(router: Process) -> int:
    replicas = httpx.get(router.url + "/router/replicas", timeout=5).json()["replicas"]
    return sum(r["eligible"] for r in replicas)


# --- metrics ------------------------------------------------------------------------------------

def scrape(url: str) -> dict[str, float]:
    """A /metrics page as {series with labels: value} (comments skipped)."""
    values = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            values[series] = float(value)
    return values


def series_sum(values: dict[str, float], name: str) -> float:
    return sum(v for k, v in values.items() if k.split("{", 1)[0] == name)


def prefix_counters(replicas: list[Process]) -> tuple[float, float]:
    pages = [scrape(r.url) for r in replicas]
    return (sum(series_sum(p, "deepserve:prefix_cache_hits_total") for p in pages),
            sum(series_sum(p, "deepserve:prefix_cache_queries_total") for p in pages))


def served_per_replica(router: Process, replicas: list[Process]) -> list[float]:
    page = scrape(router.url)

    def ok(url: str) -> float:
        labels = (f'replica="{url}"', 'outcome="ok"')
        return sum(v for k, v in page.items()
                   if k.startswith("deepserve:router_requests_total{") and all(label in k for label in labels))
    return [ok(r.url) for r in replicas]


# --- one policy ---------------------------------------------------------------------------------

def bench_command(args: argparse.Namespace, base_url: str, policy: str, out_json: str) -> list[str]:
    # --model: no /v1/models look-up, so the router's per-replica counts hold the workload and one warm-up only.
    return ["deepserve", "bench", "serve", "--base-url", base_url, "--model", MODEL, "--endpoint", "chat",
            "--shared-prefix-groups", str(args.groups), "--shared-prefix-len", str(args.prefix_len),
            "--num-prompts", str(args.groups * args.users), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--max-concurrency", str(args.max_concurrency),
            "--seed", "0", "--label", policy, "--output-json", out_json]


def run_policy(args: argparse.Namespace, log_dir: str, policy: str, kv_bytes: int | None) -> dict:
    replicas = start_replicas(log_dir, args.replicas, policy, kv_bytes)
    router = None
    try:
        router = start_router(log_dir, replicas, policy)
        blocks = series_sum(scrape(replicas[0].url), "deepserve:kv_cache_total_blocks")
        hits0, queries0 = prefix_counters(replicas)
        out_json = os.path.join(log_dir, f"bench-{policy}.json")
        command = bench_command(args, router.url, policy, out_json)
        done = subprocess.run([sys.executable, "-m", "deepserve.cli", *command[1:]], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{shlex.join(command)} failed: {done.stderr[-3000:]}")
        hits1, queries1 = prefix_counters(replicas)
        served = served_per_replica(router, replicas)
    finally:
        if router is not None:
            router.stop()
        for replica in replicas:
            replica.stop()
    with open(out_json) as f:
        run = json.load(f)["runs"][0]
    return summarize_policy(policy, command, run, (hits1 - hits0) / (queries1 - queries0), served, blocks)


def summarize_policy(policy: str, command: list[str], run: dict, hit_rate: float, served: list[float],
                     blocks: float) -> dict:
    fair = sum(served) / len(served)
    return {"policy": policy, "command": shlex.join(command), "kv_cache_blocks_per_replica": int(blocks),
            "prefix_hit_rate_replica_metrics": round(hit_rate, 4),
            "prefix_hit_rate_usage_cached_tokens": run["prefix_cache_hit_rate"],
            "ttft_ms": run["ttft_ms"], "e2e_ms": run["e2e_ms"],
            "request_throughput": run["request_throughput"], "output_throughput": run["output_throughput"],
            "completed": run["completed"], "failed": run["failed"], "duration_s": run["duration_s"],
            "served_per_replica": served, "max_share_of_fair": round(max(served) / fair, 3) if fair else None}


# --- router overhead ----------------------------------------------------------------------------

def measure_overhead(log_dir: str, pairs: int) -> dict:
    """One replica, direct and through a router (cache_aware: the default, the most work per request), in turns."""
    replicas = start_replicas(log_dir, 1, "overhead")
    router = None
    try:
        router = start_router(log_dir, replicas, "cache_aware")
        return {kind: paired_latencies(replicas[0].url, router.url, pairs, kind == "stream")
                for kind in ("plain", "stream")}
    finally:
        if router is not None:
            router.stop()
        replicas[0].stop()


def paired_latencies(direct_url: str, router_url: str, pairs: int, stream: bool) -> dict:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "temperature": 0, "stream": stream}
    direct, routed = [], []
    with httpx.Client(base_url=direct_url, timeout=60) as d, httpx.Client(base_url=router_url, timeout=60) as r:
        for client in (d, r):                                 # warm the connections and the paths
            timed_request(client, body)
        for i in range(pairs):
            # The order alternates inside a pair too, so neither side always runs right after the other.
            first, second = (d, r) if i % 2 == 0 else (r, d)
            a, b = timed_request(first, body), timed_request(second, body)
            direct.append(a if first is d else b)
            routed.append(b if first is d else a)
    added = sorted(x - y for x, y in zip(routed, direct))
    return {"pairs": pairs, "direct_ms": ms_stats(direct), "router_ms": ms_stats(routed),
            "added_ms_median_of_pair_differences": round(percentile(added, 50) * 1e3, 3),
            "added_ms_p90_of_pair_differences": round(percentile(added, 90) * 1e3, 3)}


def timed_request(client: httpx.Client, body: dict) -> float:
    start = time.perf_counter()
    if body["stream"]:
        with client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            for _ in response.iter_bytes():
                pass
    else:
        client.post("/v1/completions", json=body).raise_for_status()
    return time.perf_counter() - start


def ms_stats(seconds: list[float]) -> dict:
    ms = sorted(s * 1e3 for s in seconds)
    return {"mean": round(statistics.fmean(ms), 3), "p50": round(percentile(ms, 50), 3),
            "p99": round(percentile(ms, 99), 3)}


# --- plot ---------------------------------------------------------------------------------------

def plot(payload: dict, path: str) -> None:
    """A row per scenario (hit rate, TTFT, throughput by policy), then the router's own latency."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = payload["scenarios"]
    fig, axes = plt.subplots(len(scenarios) + 1, 3, figsize=(15, 4.2 * (len(scenarios) + 1)), squeeze=False)
    for row, scenario in zip(axes, scenarios):
        plot_scenario(row, scenario)
    overhead = payload["router_overhead"]
    kinds = list(overhead)
    bars(axes[-1][0], kinds, {"direct p50": [overhead[k]["direct_ms"]["p50"] for k in kinds],
                              "router p50": [overhead[k]["router_ms"]["p50"] for k in kinds],
                              "added (median of pairs)": [overhead[k]["added_ms_median_of_pair_differences"]
                                                          for k in kinds]},
         "router overhead: 1-token request, 1 replica (ms)")
    for ax in axes[-1][1:]:
        ax.axis("off")
    w = payload["workload"]
    fig.suptitle(f"{payload['replicas']} replicas of {MODEL} (CPU, {payload['machine']['cpu_count']} cores): "
                 f"{w['groups']} system prompts of {w['prefix_words']} words x {w['users']} users, "
                 f"{w['output_len']} tokens out, concurrency {w['max_concurrency']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_scenario(row, scenario: dict) -> None:
    runs = scenario["policies"]
    names = [r["policy"] for r in runs]
    tag = f"{scenario['name']} ({runs[0]['kv_cache_blocks_per_replica']} blocks/replica)"
    bars(row[0], names, {"replicas' /metrics": [r["prefix_hit_rate_replica_metrics"] for r in runs],
                         "answers' cached_tokens": [r["prefix_hit_rate_usage_cached_tokens"] for r in runs]},
         f"prefix-cache hit rate, {tag}")
    row[0].set_ylim(0, 1)
    bars(row[1], names, {"mean": [r["ttft_ms"]["mean"] for r in runs], "p50": [r["ttft_ms"]["median"] for r in runs],
                         "p99": [r["ttft_ms"]["p99"] for r in runs]}, "TTFT (ms)")
    bars(row[2], names, {"requests/s": [r["request_throughput"] for r in runs],
                         "output tokens/s / 10": [r["output_throughput"] / 10 for r in runs]}, "throughput")


def bars(ax, names: list[str], series: dict[str, list[float]], title: str) -> None:
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        drawn = ax.bar([p + i * width for p in range(len(names))], values, width, label=label)
        ax.bar_label(drawn, fmt="%.3g", fontsize=7)
    ax.set_xticks([p + width * (len(series) - 1) / 2 for p in range(len(names))], names)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)


# --- main ---------------------------------------------------------------------------------------

def working_tree_note() -> str:
    """machine_info records the commit; say whether the code measured had uncommitted changes on top of it."""
    try:
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, timeout=10, cwd=os.path.dirname(os.path.abspath(__file__))).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown (git not available)"
    return "uncommitted changes on top of the commit: " + ", ".join(sorted(l[3:] for l in changed.splitlines())) \
        if changed.strip() else "the commit, unchanged"


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    load_start = os.getloadavg()[0]
    started = time.time()
    scenarios = [("default KV cache", None)]
    if args.tight_kv_bytes:
        scenarios.append(("tight KV cache", args.tight_kv_bytes))
    with tempfile.TemporaryDirectory(prefix="router-bench-") as log_dir:
        results = [run_scenario(args, log_dir, name, kv_bytes) for name, kv_bytes in scenarios]
        overhead = measure_overhead(log_dir, args.overhead_pairs)
    payload = {
        "what": __doc__.split("\n\n")[0],
        "command": "python benchmarks/router.py " + shlex.join(argv),
        "replicas": args.replicas,
        "workload": {"groups": args.groups, "users": args.users, "prefix_words": args.prefix_len,
                     "question_words": args.input_len, "output_len": args.output_len,
                     "max_concurrency": args.max_concurrency, "endpoint": "chat"},
        "scenarios": results,
        "router_overhead": overhead,
        "machine": machine_info(),
        "tree": working_tree_note(),
        # A shared 2-core VM: other engineers' tests run at times; the 1-minute load averages show how much.
        "load_average_1m_start_end": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "noise_note": NOISE_NOTE,
        "wall_s": round(time.time() - started, 1),
    }
    write_json(args.output, payload)
    plot(payload, os.path.splitext(args.output)[0] + ".png")


def run_scenario(args: argparse.Namespace, log_dir: str, name: str, kv_bytes: int | None) -> dict:
    policies = []
    for policy in args.policies:
        load_before = os.getloadavg()[0]
        policies.append({**run_policy(args, log_dir, policy, kv_bytes),
                         "load_average_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)]})
        print(name, json.dumps(policies[-1]), flush=True)
    return {"name": name, "kv_cache_memory_bytes": kv_bytes, "policies": policies}


if __name__ == "__main__":
    main(sys.argv[1:])
