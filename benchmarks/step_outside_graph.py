"""What a steady decode step runs on the GPU outside its CUDA graph (a diagnostic beside h200_decode_sweep.py, whose
step_ms - graph_replay_ms is this time): every device operation of a few engine steps under torch.profiler, split
by whether it belongs to a graph launch (same correlation id as a `cudaGraphLaunch`) or was launched on its own
(input copies, the in-flight token patch, sampling, the copy of the tokens to the host).

Per (shape, batch): the mean step (one graph launch to the next), the graph's span, the time between one graph's
last kernel and the next graph's first, and the operations in that interval with their durations and start offsets.

Run (GPU machine):  python benchmarks/step_outside_graph.py --cases qwen3-moe:8,deepseek-v2-lite:128,256 --output F
Plot (any machine): python benchmarks/step_outside_graph.py --plot F   (the PNG beside F)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import h200_decode_sweep as sweep  # noqa: E402
from profile_gpu_step import start_decoding  # noqa: E402
from deepserve import LLM  # noqa: E402


def device_ops(prof) -> tuple[list, set]:
    """(GPU operations as (start_us, end_us, name, correlation id), correlation ids of graph launches)."""
    events = prof.profiler.kineto_results.events()
    graph_ids = {e.correlation_id() for e in events if e.name() == "cudaGraphLaunch"}
    ops = sorted((e.start_ns() / 1e3, (e.start_ns() + e.duration_ns()) / 1e3, e.name(), e.correlation_id())
                 for e in events if e.device_type() == torch.autograd.DeviceType.CUDA and e.duration_ns() > 0)
    return ops, graph_ids


def between_graphs(ops: list, graph_ids: set) -> dict:
    """Group the operations into graph launches and what runs between them."""
    launches: list[list] = []          # [corr, first start, last end]
    for start, end, _, corr in ops:
        if corr in graph_ids:
            if launches and launches[-1][0] == corr:
                launches[-1][2] = max(launches[-1][2], end)
            else:
                launches.append([corr, start, end])
    gaps = []
    for (_, _, prev_end), (_, next_start, _) in zip(launches, launches[1:]):
        inside = [(round(s - prev_end, 1), round(e - s, 1), n[:60]) for s, e, n, c in ops
                  if c not in graph_ids and prev_end <= s < next_start]
        gaps.append({"gap_us": round(next_start - prev_end, 1), "ops": inside})
    steps = [b[1] - a[1] for a, b in zip(launches, launches[1:])]
    return {"graph_launches": len(launches),
            "step_us_mean": round(sum(steps) / len(steps), 1) if steps else None,
            "graph_span_us_mean": round(sum(e - s for _, s, e in launches) / len(launches), 1) if launches else None,
            "between_graphs_us_mean": round(sum(g["gap_us"] for g in gaps) / len(gaps), 1) if gaps else None,
            "between_graphs": gaps[-3:]}


def run_case(name: str, batches: list[int], context: int, steps: int) -> dict:
    config = sweep.h200_dense.write_config(sweep.DENSE[name]) if name in sweep.DENSE else \
        sweep.h200_moe.write_config(sweep.MOE[name])
    max_len = context + steps + 64
    with open(os.path.join(config, "config.json")) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = max(cfg.get("max_position_embeddings", 0), max_len)
    with open(os.path.join(config, "config.json"), "w") as f:
        json.dump(cfg, f)
    llm = LLM(config, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=max_len,
              max_num_seqs=max(batches), max_num_batched_tokens=sweep.MAX_BATCHED_TOKENS, gpu_memory_utilization=0.85)
    out = {}
    for batch in batches:
        eng = llm.engine
        start_decoding(eng, batch, context, steps + 16, f"{name}-outside", batch)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                eng.step()
            torch.cuda.synchronize()
        while eng.has_unfinished_requests():
            eng.step()
        out[str(batch)] = between_graphs(*device_ops(prof))
        print(name, batch, json.dumps(out[str(batch)])[:3000], flush=True)
    del llm, eng, prof
    gc.collect()
    torch.cuda.empty_cache()
    return out


def plot(path: str) -> None:
    """Per (shape, batch): the mean step, the graph's span and the time between two graphs, into F's .png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(path) as f:
        data = json.load(f)
    cases = [(f"{shape} b{batch}", r) for shape, by_batch in data["results"].items() for batch, r in by_batch.items()]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(range(len(cases)), [r["between_graphs_us_mean"] for _, r in cases])
    for i, (_, r) in enumerate(cases):
        ax.annotate(f"step {r['step_us_mean']} us\nspan {r['graph_span_us_mean']} us", (i, r["between_graphs_us_mean"]),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(cases)), [name for name, _ in cases])
    ax.set_ylabel("us between two graph replays")
    ax.set_title(f"{data['gpu']}: device time outside the decode graph", fontsize=9)
    fig.tight_layout()
    fig.savefig(path.rsplit(".", 1)[0] + ".png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plot", help="a JSON this script wrote: draw its PNG and exit")
    ap.add_argument("--cases", default="qwen3-moe:8;deepseek-v2-lite:128,256", help="shape:batches;...")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--output", default="step_outside_graph.json")
    args = ap.parse_args()
    if args.plot:
        plot(args.plot)
        return
    result = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "results": {}}
    for case in args.cases.split(";"):
        name, batches = case.split(":")
        result["results"][name] = run_case(name, [int(b) for b in batches.split(",")], args.context, args.steps)
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
