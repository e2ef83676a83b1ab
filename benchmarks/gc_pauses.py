"""Garbage-collection pauses inside decode steps, with the start-up heap frozen (DEEPSERVE_GC_FREEZE=1, the default:
engine/startup_heap.py) and without, in one run: each setting in a process of its own, the same workload in each.

Per setting: the objects a full collection walks right after start-up and the time of one forced full collection;
then a workload of `--requests` requests (`--max-tokens` each, at most `--batch` running) stepped through the engine,
with every collection the interpreter ran during it timed (gc.callbacks): how many per generation, their total and
longest pause, and the steps' p50 / p99 / max times. The requests' outputs are kept, as LLM.generate keeps them.

Run:  python benchmarks/gc_pauses.py [--model DIR] [--requests 1500] --output benchmarks/gc_pauses_cpu.json
      (the PNG beside the JSON; `--plot JSON` draws it again without measuring)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure_here(args) -> dict:
    from deepserve import LLM, SamplingParams
    from deepserve.loader.gguf_loader import default_model_path
    llm = LLM(args.model or default_model_path(), max_num_seqs=args.batch, seed=0)
    walked = len(gc.get_objects())
    t0 = time.perf_counter()
    gc.collect()
    forced_ms = (time.perf_counter() - t0) * 1e3
    pauses: list[tuple[int, float]] = []
    started: list[float] = []

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append((info["generation"], (time.perf_counter() - started.pop()) * 1e3))

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    kept, steps = [], []
    gc.callbacks.append(on_gc)
    try:
        for i in range(args.requests):
            engine.add_request(f"r{i}", f"Request {i}: write a line about the number {i * 7919 % 1000}.", params)
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            kept.extend(o for o in engine.step() if o.finished)
            steps.append((time.perf_counter() - t0) * 1e3)
    finally:
        gc.callbacks.remove(on_gc)
    steps.sort()
    by_gen = {g: [ms for gen, ms in pauses if gen == g] for g in (0, 1, 2)}
    return {"objects_walked_by_a_full_collection": walked, "forced_full_collection_ms": round(forced_ms, 2),
            "frozen_objects": gc.get_freeze_count(), "finished_requests": len(kept), "steps": len(steps),
            "step_ms_p50": round(steps[len(steps) // 2], 2), "step_ms_p99": round(steps[int(len(steps) * 0.99)], 2),
            "step_ms_max": round(steps[-1], 2),
            "collections": {str(g): {"count": len(v), "total_ms": round(sum(v), 2),
                                     "max_ms": round(max(v, default=0.0), 2)} for g, v in by_gen.items()}}


def plot(path: str) -> None:
    """Per setting: one forced full collection's time, and the full collections' total and longest pause in the
    workload."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(path) as f:
        data = json.load(f)
    settings = [k for k, v in data["by_setting"].items() if "error" not in v]
    bars = {"one forced full collection": lambda r: r["forced_full_collection_ms"],
            "full collections in the workload, total": lambda r: r["collections"]["2"]["total_ms"],
            "full collections in the workload, longest": lambda r: r["collections"]["2"]["max_ms"]}
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(settings)
    for j, setting in enumerate(settings):
        row = data["by_setting"][setting]
        ax.bar([i + j * width for i in range(len(bars))], [get(row) for get in bars.values()], width, label=setting)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(bars))], list(bars), fontsize=7)
    ax.set_ylabel("ms")
    ax.set_title(data["command"][:110], fontsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.splitext(path)[0] + ".png", dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--settings", default="1,0", help="DEEPSERVE_GC_FREEZE values, one process each")
    ap.add_argument("--output", default="gc_pauses.json")
    ap.add_argument("--plot", metavar="JSON", help="draw JSON's PNG beside it, measure nothing")
    ap.add_argument("--here", action="store_true", help="(internal) measure in this process")
    args = ap.parse_args()
    if args.here:
        print("RESULT " + json.dumps(measure_here(args)))
        return
    if args.plot:
        plot(args.plot)
        return
    import platform
    result = {"command": " ".join(["python"] + sys.argv), "python": platform.python_version(),
              "cpu": platform.processor() or platform.machine(), "by_setting": {}}
    passthrough = [a for a in sys.argv[1:] if not a.startswith("--output") and a != args.output]
    for setting in args.settings.split(","):
        env = dict(os.environ, DEEPSERVE_GC_FREEZE=setting)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--here", *passthrough], env=env,
                              capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        result["by_setting"][f"DEEPSERVE_GC_FREEZE={setting}"] = (
            json.loads(lines[-1][7:]) if lines and not proc.returncode else {"error": proc.stderr[-3000:]})
        print(setting, json.dumps(result["by_setting"][f"DEEPSERVE_GC_FREEZE={setting}"]), flush=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)
    plot(args.output)


if __name__ == "__main__":
    main()
