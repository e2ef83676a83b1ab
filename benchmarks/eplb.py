"""EPLB policy: balance before / after rebalancing, deepserve's policy vs DeepSeek's open-source one.

Loads (per Zipf exponent s, one seed, the same tensor for both policies):
  for each layer, expert popularity p ∝ 1 / rank^s over a random permutation of the experts; each step
  multiplies p by log-normal noise (sigma --noise, fresh per step and expert) so steps differ; p is then
  capped at 1 / top_k (a token picks an expert at most once) with the excess spread over the rest; the
  step's count per expert is Poisson(tokens * top_k * p). Counts are therefore [steps, layers, experts].
Scored for each (s, ranks, extra replicas per rank): balance_ratio (Σ max-rank / Σ mean-rank load, over
steps and layers) of the identity layout (before), of DeepSeek's global policy and of ours, both fed the
same window; and each policy's wall time (median of --repeats) on this machine's CPU.

Run:  python benchmarks/eplb.py --output benchmarks/eplb.json --plot benchmarks/eplb.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling eplb_deepseek.py

import eplb_deepseek  # noqa: E402

from deepserve import eplb  # noqa: E402

POLICIES = {"deepserve": eplb.rebalance, "deepseek": eplb_deepseek.rebalance}


def cap_popularity(p: torch.Tensor, cap: float) -> torch.Tensor:
    """Water-fill: clip rows of p at cap and spread the excess over the unclipped experts, repeated until
    nothing exceeds the cap (each pass clips at least one more expert, so it ends)."""
    p = p / p.sum(-1, keepdim=True)
    for _ in range(p.shape[-1]):
        over = p > cap
        if not over.any():
            break
        excess = (p - cap).clamp(min=0).sum(-1, keepdim=True)
        free = torch.where(p >= cap, 0.0, p)
        p = torch.where(p >= cap, torch.full_like(p, cap), p + excess * free / free.sum(-1, keepdim=True))
    return p


def zipf_loads(s, experts, layers, steps, tokens, top_k, noise, seed) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ranks = torch.stack([torch.randperm(experts, generator=gen) for _ in range(layers)]) + 1  # [L, E]
    base = ranks.to(torch.float64) ** -s
    jitter = torch.exp(noise * torch.randn(steps, layers, experts, generator=gen, dtype=torch.float64))
    p = cap_popularity(base * jitter, 1.0 / top_k)
    return torch.poisson(p * tokens * top_k, generator=gen)


def timed(policy, loads, num_ranks, physical, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        placement = policy(loads, num_ranks, physical)
        times.append(time.perf_counter() - start)
    return placement, statistics.median(times)


def run_case(loads, num_ranks, extra_per_rank, repeats) -> dict:
    layers, experts = loads.shape[1], loads.shape[2]
    physical = experts + extra_per_rank * num_ranks
    row = {
        "ranks": num_ranks,
        "extra_per_rank": extra_per_rank,
        "physical_experts": physical,
        "before": eplb.balance_ratio(loads, eplb.identity_placement(layers, experts, num_ranks), num_ranks),
    }
    for name, policy in POLICIES.items():
        placement, seconds = timed(policy, loads, num_ranks, physical, repeats)
        row[name] = eplb.balance_ratio(loads, placement, num_ranks)
        row[f"{name}_s"] = seconds
    return row


def git(*args) -> str:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def plot(results: list[dict], path: str) -> None:
    """Top: all three layouts on a log scale. Bottom: the two policies alone where they have extra
    replicas, on a linear scale, where their difference is visible."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    exponents = sorted({r["s"] for r in results})
    fig, axes = plt.subplots(2, len(exponents), figsize=(6 * len(exponents), 8), squeeze=False)
    series = [("before", "identity", "C0"), ("deepseek", "DeepSeek EPLB (global)", "C1"), ("deepserve", "deepserve", "C2")]
    for col, s in enumerate(exponents):
        rows = [r for r in results if r["s"] == s]
        bars(axes[0, col], rows, series, f"Zipf s = {s}: all layouts")
        axes[0, col].set_yscale("log")
        bars(axes[1, col], [r for r in rows if r["extra_per_rank"] > 0], series[1:], f"Zipf s = {s}: with extra replicas")
        axes[1, col].set_ylim(1.0, None)
    for row in range(2):
        axes[row, 0].set_ylabel("Σ max-rank / Σ mean-rank")
        axes[row, 0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def bars(ax, rows, series, title) -> None:
    x = list(range(len(rows)))
    width = 0.8 / len(series)
    for i, (key, label, colour) in enumerate(series):
        offset = (i - (len(series) - 1) / 2) * width
        ax.bar([v + offset for v in x], [r[key] for r in rows], width, label=label, color=colour)
    ax.set_xticks(x, [f"{r['ranks']}r\n+{r['extra_per_rank']}" for r in rows], fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_title(title)
    ax.set_xlabel("ranks / extra replicas per rank")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exponents", type=float, nargs="+", default=[0.8, 1.0, 1.2])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64])
    ap.add_argument("--extra", type=int, nargs="+", default=[0, 1, 2], help="extra replicas per rank")
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per step")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--noise", type=float, default=0.2, help="per-step log-normal sigma on popularity")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", default="benchmarks/eplb.json")
    ap.add_argument("--plot", default="benchmarks/eplb.png")
    args = ap.parse_args()

    torch.set_num_threads(1)  # a shared 2-core box: one thread keeps the timings comparable
    results = []
    for s in args.exponents:
        loads = zipf_loads(s, args.experts, args.layers, args.steps, args.tokens, args.top_k, args.noise, args.seed)
        for num_ranks in args.ranks:
            for extra in args.extra:
                row = {"s": s, **run_case(loads, num_ranks, extra, args.repeats)}
                results.append(row)
                print(
                    f"s={s} ranks={num_ranks:3d} +{extra}: before {row['before']:.3f}  deepseek {row['deepseek']:.3f} "
                    f"({row['deepseek_s'] * 1e3:.0f} ms)  deepserve {row['deepserve']:.3f} ({row['deepserve_s'] * 1e3:.0f} ms)",
                    flush=True,
                )
    report = {
        "command": shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain")),
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "note": "shared CPU, timings noisy",
        },
        "loads": {k: getattr(args, k) for k in ("experts", "layers", "steps", "tokens", "top_k", "noise", "seed")},
        "load_model": "Loads" + __doc__.split("Loads", 1)[1].split("Run:")[0].rstrip(),
        "results": results,
    }
    with open(args.output, "w") as f:
        json.dump(report, f, indent=1)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
