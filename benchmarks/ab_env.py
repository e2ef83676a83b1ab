"""A/B of environment switches (DEEPSERVE_* variables): for each configuration a fresh process builds the engine
(random bf16 weights of the real shape, CUDA graphs) and measures the batch-1 graph replay at contexts 1 and 193 and
the engine's batch-1 decode (128 in / 128 out, best of two); with --offline also 256 x 128/128 offline throughput
(greedy, three runs: the first includes warm-up effects, and runs vary by 10-20%) and the batch-256 graph replay.
Configurations run back to back in one session, so their differences are what the switches change (a diagnostic,
not a benchmark of record).

Run (GPU machine):
  python benchmarks/ab_env.py --output ab.json --shapes llama-3.2-1b \\
      --config base:DEEPSERVE_FUSED_NORMS=0 --config fused:DEEPSERVE_FUSED_NORMS=1 [--offline]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(shape: str, offline: bool) -> dict:
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import profile_gpu_step as prof
    from deepserve.bench.throughput import run_latency, run_throughput
    llm = prof.engine(prof.config_dir(shape))
    runs = [run_latency(llm, 1, 128, 128) for _ in range(2)]
    res = {"decode_tokens_per_s": max(r["decode_tokens_per_s"] for r in runs),
           "graph_replay_b1_ms_ctx1": prof.graph_replay_ms(llm, 1, 1),
           "graph_replay_b1_ms_ctx193": prof.graph_replay_ms(llm, 1, 193)}
    if offline:
        res["offline_output_tokens_per_s"] = [run_throughput(llm, 256, 128, 128, temperature=0.0)
                                              ["output_tokens_per_s"] for _ in range(3)]
        res["graph_replay_b256_ms_ctx193"] = prof.graph_replay_ms(llm, 256, 193, reps=50)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-3.2-1b")
    ap.add_argument("--config", action="append", default=[], help="name:VAR=VALUE,VAR=VALUE (repeatable)")
    ap.add_argument("--offline", action="store_true", help="also offline throughput and the batch-256 replay")
    ap.add_argument("--output", default="ab_env.json")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.offline)), flush=True)
        return
    out = {"command": "python " + " ".join(sys.argv), "results": {}}
    for spec in args.config or ["default:"]:
        name, _, assigns = spec.partition(":")
        env = dict(os.environ)
        env.update(a.split("=", 1) for a in assigns.split(",") if a)
        for shape in args.shapes.split(","):
            t0 = time.perf_counter()
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", shape]
            if args.offline:
                cmd.append("--offline")
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            res = json.loads(lines[-1][7:]) if lines else {"error": proc.stderr[-2000:]}
            out["results"].setdefault(name, {})[shape] = res
            print(f"{name} {shape} ({time.perf_counter() - t0:.0f}s): {json.dumps(res)}", flush=True)
            with open(args.output, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
