"""KV store: time to first token of 2k / 8k-token prompts, cold vs served from each tier of the store (CPU).

The default model (SmolLM2-135M, max_model_len 8192), for each prompt length:
  cold  an engine without a store, a prompt it has never seen; and the engine with the store, whose cold run
        saves every block (write-behind) into the memory, disk and Redis tiers at once;
  hit   the same prompt again after the device prefix cache is emptied (`reset_prefix_cache`), the store holding
        one tier alone, so every block but the last comes from that tier (median of --repeats).
TTFT = first token time - arrival (the engine's own metrics).
Disk hits read files the OS page cache holds (just written): that is the hot-file case, not a cold disk.
Redis: a redis-server started here on a free port (skipped if the binary is absent).

Run:  python benchmarks/kvstore.py --output benchmarks/kvstore.json --plot benchmarks/kvstore.png
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from deepserve import LLM
from deepserve.bench.throughput import machine_info, write_json
from deepserve.kvstore.disk_tier import DiskTier
from deepserve.kvstore.memory_tier import MemoryTier
from deepserve.kvstore.redis_tier import RedisTier
from deepserve.kvstore.store import KVStore
from deepserve.sampling_params import SamplingParams

ENGINE = {"max_model_len": 8192, "max_num_seqs": 4, "seed": 0}
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(length)]


def ttft(llm: LLM, ids: list[int]) -> tuple[float, int]:
    out = llm.generate({"prompt_token_ids": ids}, ONE_TOKEN, use_tqdm=False)[0]
    return out.metrics.first_token_time - out.metrics.arrival_time, out.num_cached_tokens


def measure_cold(llm: LLM, lengths: list[int], seed: int) -> dict:
    ttft(llm, prompt(64, seed=999))                      # warm-up: first-call costs out of the numbers
    rows = {}
    for length in lengths:
        seconds, cached = ttft(llm, prompt(length, seed + length))
        rows[str(length)] = {"cold_s": seconds, "cold_cached_tokens": cached}
        print(f"  cold {length:5d} tokens: {seconds:.3f} s", flush=True)
    return rows


def measure_hits(llm: LLM, tiers: dict, lengths: list[int], repeats: int, seed: int) -> dict:
    """One engine whose store saves into every tier at once (the cold run), then, for each tier alone, the same
    prompts again with the device prefix cache emptied: every block but the tail one is loaded from that tier."""
    connector = llm.engine.kv_store

    def use(store: KVStore) -> None:       # the connector saves through `store`, its background fetcher reads it
        connector.store = connector.fetcher.store = store
    use(KVStore(list(tiers.values())))
    cold = measure_cold(llm, lengths, seed)
    connector.store.flush()
    results = {"cold_with_store": cold}
    for name, tier in tiers.items():
        use(KVStore([tier]))
        rows = {}
        for length in lengths:
            ids = prompt(length, seed + length)
            runs = []
            for _ in range(repeats):
                llm.reset_prefix_cache()
                runs.append(ttft(llm, ids))
            hit = statistics.median(r for r, _ in runs)
            rows[str(length)] = {"hit_s": hit, "hit_runs_s": [r for r, _ in runs], "hit_cached_tokens": runs[0][1],
                                 "speedup_vs_cold": cold[str(length)]["cold_s"] / hit}
            print(f"  {name} hit {length:5d} tokens: {hit:.3f} s ({runs[0][1]} tokens from the store)", flush=True)
        rows["store_metrics"] = connector.store.metrics()
        results[name] = rows
    return results


def start_redis() -> tuple[subprocess.Popen | None, str | None]:
    binary = shutil.which("redis-server")
    if binary is None:
        return None, None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc, f"redis://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    return None, None


def plot(results: dict, lengths: list[int], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [("cold (no store)", results["none"], "cold_s")]
    series += [("cold (saving to the store)", results["cold_with_store"], "cold_s")]
    series += [(f"hit: {tier}", results[tier], "hit_s") for tier in ("memory", "disk", "redis") if tier in results]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(series)
    for i, (label, rows, key) in enumerate(series):
        xs = [j + i * width for j in range(len(lengths))]
        ys = [rows[str(n)][key] for n in lengths]
        bars = ax.bar(xs, ys, width, label=label)
        ax.bar_label(bars, labels=[f"{y:.2f}s" for y in ys], fontsize=7)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(lengths))], [f"{n} tokens" for n in lengths])
    ax.set_yscale("log")
    ax.set_ylabel("time to first token (s, log)")
    ax.set_title("KV store: TTFT cold vs hit per tier (SmolLM2-135M, CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 8000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="benchmarks/kvstore.json")
    parser.add_argument("--plot", default="benchmarks/kvstore.png")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: on a shared 2-core VM two OpenMP threads spin against the neighbours)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    redis_proc, redis_url = start_redis()
    workdir = tempfile.mkdtemp(prefix="kvstore-bench-")
    tiers = {"memory": MemoryTier(4 << 30), "disk": DiskTier(os.path.join(workdir, "kv"), 16 << 30)}
    try:
        if redis_url:
            tiers["redis"] = RedisTier(redis_url, 4 << 30, timeout_s=5.0, retry_interval_s=1.0)
        print("no store:", flush=True)
        baseline = LLM(**ENGINE)
        results = {"none": measure_cold(baseline, args.lengths, args.seed)}
        del baseline
        print("store:", flush=True)
        llm = LLM(**ENGINE, kv_store={"backend": "memory"})
        results.update(measure_hits(llm, tiers, args.lengths, args.repeats, args.seed))
    finally:
        if redis_proc is not None:
            redis_proc.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    payload = {"command": "python " + shlex.join(sys.argv), "engine": ENGINE, "lengths": args.lengths,
               "threads": args.threads,
               "notes": ["TTFT = first_token_time - arrival_time of a max_tokens=1 greedy request",
                         ("cold (none): an engine without a store; cold_with_store: the engine whose store saves "
                         "every block to the memory, disk and Redis tiers at once (write-behind)"),
                         ("hit: device prefix cache emptied first; the store then holds that one tier alone, and all "
                         "blocks but the tail one come from it"),
                         "disk hits are page-cache hits (files just written); redis on localhost",
                         "store blocks are fetched on background threads, then copied in at admission "
                         "(engine/kv_store_connector.py)"],
               "redis": "skipped: no redis-server" if not redis_url else "redis-server on localhost",
               "results": results, "machine": machine_info()}
    write_json(args.output, payload)
    if args.plot:
        plot(results, args.lengths, args.plot)
    print(f"wrote {args.output}" + (f" and {args.plot}" if args.plot else ""))


if __name__ == "__main__":
    main()
