"""The batch-invariant linear layer's C kernel (kernels/cpu/invariant_linear.c) against F.linear on the CPU, by row
count, on the default model's MLP shape (576 -> 1536) and its down projection (1536 -> 576), float32. `--lanes 8,16`
builds the kernel at both vector widths (-DLINEAR_LANES: 16 floats, AVX-512's register, or 8, AVX's; the CPU's own
width is the default build) and times them in the same run, rounds alternating; best of `--repeats` is reported.
`--stream`: instead, a model's worth of distinct weights (the default model's 30 layers: qkv, o, gate/up, down, 425
MB of float32, so each call reads its weight from memory as a decode step does) and its 113 MB LM head at 1 / 2 / 4
rows, the C kernel (this CPU's build) against F.linear, in GB/s of weight read (why layers/linear.py sends few rows
to the kernel).

Run:  python benchmarks/cpu_invariant_linear.py [--lanes 8,16] [--stream] [--output F.json]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from deepserve.bench.throughput import machine_info, write_json
from deepserve.kernels.cpu import build as cpu_build
from deepserve.kernels.cpu import invariant_linear as il


def kernel_call(lib, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor):
    (m, k), n = x.shape, w.shape[0]
    return lambda: lib.invariant_linear(x.data_ptr(), k, w.data_ptr(), k, None, y.data_ptr(), n, m, n, k,
                                        torch.get_num_threads())


def best_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(result["us_per_call"]), figsize=(5.5 * len(result["us_per_call"]), 3.8))
    for ax, (shape, rows) in zip(axes if len(result["us_per_call"]) > 1 else [axes], result["us_per_call"].items()):
        ms = [int(m) for m in rows]
        for name in next(iter(rows.values())):
            ax.plot(ms, [rows[str(m)][name] / rows[str(m)]["F.linear"] for m in ms], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows")
        ax.set_ylabel("time / F.linear's")
        ax.set_title(shape, fontsize=9)
        ax.legend(fontsize=8)
    finish(fig, result, "invariant_linear (C) vs F.linear", path)


def finish(fig, result: dict, what: str, path: str) -> None:
    """The figure's title (what, threads, the CPU and its vector flags), then the PNG."""
    cpu = result["setup"]["cpu"]
    fig.suptitle(f"{what}, {result['setup']['torch_threads']} threads: {cpu['model']}, "
                 f"{' '.join(f for f in cpu['isa_flags'] if 'avx' in f or 'amx' in f)}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_stream(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, (case, rows) in zip(axes, result["stream"].items()):
        ms = list(rows)
        for k, name in enumerate(("C", "F.linear")):
            ax.bar([i + 0.4 * k for i in range(len(ms))], [rows[m][name]["gb_per_s"] for m in ms], 0.4, label=name)
        ax.set_xticks([i + 0.2 for i in range(len(ms))], [f"{m} rows" for m in ms])
        ax.set_ylabel("GB/s of weight read")
        ax.set_title({"layers": "120 distinct layer weights (425 MB)", "lm_head": "LM head (113 MB)"}[case], fontsize=9)
        ax.legend(fontsize=8)
    finish(fig, result, "float32", path)


def stream(args) -> dict:
    """GB/s of weight read by a pass over 120 distinct layer weights and by the LM head, C kernel against F.linear."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    weights = [torch.randn(n, k, generator=gen) for _ in range(30) for n, k in shapes]
    head = torch.randn(49152, 576, generator=gen)
    out: dict = {}
    for m in map(int, args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}
        cases = {"layers": weights, "lm_head": [head]}
        for case, ws in cases.items():
            gb = sum(w.numel() for w in ws) * 4 / 1e9
            fns = {"C": lambda ws=ws: [il.invariant_linear(xs[w.shape[1]], w) for w in ws],
                   "F.linear": lambda ws=ws: [F.linear(xs[w.shape[1]], w) for w in ws]}
            best = {name: float("inf") for name in fns}
            for _ in range(args.repeats):
                for name, fn in fns.items():
                    t = time.perf_counter()
                    fn()
                    best[name] = min(best[name], time.perf_counter() - t)
            out.setdefault(case, {})[str(m)] = {name: {"ms": round(v * 1e3, 2), "gb_per_s": round(gb / v, 1)}
                                                 for name, v in best.items()}
            print(case, m, out[case][str(m)], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lanes", default="", help="comma-separated vector widths to build the kernel at (8, 16)")
    ap.add_argument("--rows", default="1,8,32,256")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stream", action="store_true", help="a model's distinct weights read from memory, 1-4 rows")
    ap.add_argument("--output", default="benchmarks/cpu_invariant_linear.json")
    args = ap.parse_args()
    if args.stream:
        if args.rows == "1,8,32,256":
            args.rows = "1,2,4"
        result = {"command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "stream": stream(args),
                  "setup": {**vars(args), "date": time.strftime("%Y-%m-%d"), **machine_info()}}
        write_json(args.output, result)
        plot_stream(result, str(Path(args.output).with_suffix(".png")))
        return
    builds = {f"C@{lanes}": (f"LINEAR_LANES={lanes}",) for lanes in args.lanes.split(",")} if args.lanes \
        else {"C": ()}
    libs = {name: cpu_build.load(il._SOURCE, il.SIGNATURE, defines=defines) for name, defines in builds.items()}
    gen = torch.Generator().manual_seed(0)
    us: dict = {}
    for n, k in [(1536, 576), (576, 1536)]:
        w = torch.randn(n, k, generator=gen)
        shape = f"{k} -> {n}"
        us[shape] = {}
        for m in map(int, args.rows.split(",")):
            x, y = torch.randn(m, k, generator=gen), torch.empty(m, n)
            calls = {name: kernel_call(lib, x, w, y) for name, lib in libs.items()}
            calls["F.linear"] = lambda: F.linear(x, w)
            reps = max(3, 2000 // m)
            best = {name: float("inf") for name in calls}
            for fn in calls.values():
                fn()
            for _ in range(args.repeats):
                for name, fn in calls.items():
                    best[name] = min(best[name], best_us(fn, reps))
            us[shape][str(m)] = {name: round(v, 1) for name, v in best.items()}
            print(shape, m, us[shape][str(m)])
    result = {"command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "us_per_call": us,
              "setup": {**vars(args), "date": time.strftime("%Y-%m-%d"), **machine_info()}}
    write_json(args.output, result)
    plot(result, str(Path(args.output).with_suffix(".png")))


if __name__ == "__main__":
    main()
