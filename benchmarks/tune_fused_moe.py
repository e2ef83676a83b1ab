"""Tile configurations of the fused MoE kernels at prefill sizes, timed on the GPU (a tuning aid).

For each MoE shape and token count, every candidate MoEConfig runs `fused_moe` end to end (align + gate/up +
down + combine); the table lists ms and the achieved TFLOP/s (2 * pairs * 3 * H * I flops), beside what the
engine's heuristic (`pick_config`) picks and a dense cuBLAS GEMM of the same flops as a reference point.

Run (GPU machine):  python benchmarks/tune_fused_moe.py --output tune_fused_moe.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepserve.kernels.fused_moe import MoEConfig, fused_moe, pick_config  # noqa: E402

SHAPES = {"qwen3-moe": dict(experts=128, top_k=8, hidden=2048, inter=768),
          "deepseek-v2-lite": dict(experts=64, top_k=6, hidden=2048, inter=1408),
          # benchmarks/h200_v41.py's scaled V4.1 (the full expert width, 64 experts)
          "deepseek-v41-scaled": dict(experts=64, top_k=6, hidden=5120, inter=2304)}
CANDIDATES = [MoEConfig(128, 128, 128, 64, 8, 3), MoEConfig(128, 64, 128, 64, 8, 3), MoEConfig(128, 64, 64, 64, 4, 3),
              MoEConfig(64, 128, 128, 64, 4, 3), MoEConfig(64, 64, 64, 64, 4, 3), MoEConfig(64, 64, 128, 64, 4, 4),
              MoEConfig(128, 64, 128, 64, 8, 4), MoEConfig(64, 128, 64, 64, 8, 3)]


def bench(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def run(name: str, s: dict, tokens: int) -> dict:
    dev = "cuda"
    e, k, h, i = s["experts"], s["top_k"], s["hidden"], s["inter"]
    x = torch.randn(tokens, h, device=dev, dtype=torch.bfloat16)
    w13 = torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(e, h, i, device=dev, dtype=torch.bfloat16) * 0.02
    logits = torch.randn(tokens, e, device=dev)
    weights, ids = logits.softmax(-1).topk(k, dim=-1)
    flops = 2 * tokens * k * 3 * h * i
    res = {"tokens": tokens, "heuristic": str(pick_config(tokens * k, e, i, h, x.device)), "configs": {}}
    a = torch.randn(tokens * k, h, device=dev, dtype=torch.bfloat16)
    b = torch.randn(h, 3 * i, device=dev, dtype=torch.bfloat16)
    ms = bench(lambda: a @ b)
    res["dense_gemm_same_flops_ms"] = round(ms, 3)
    for cfg in [None] + CANDIDATES:
        t0 = time.perf_counter()
        try:
            ms = bench(lambda: fused_moe(x, w13, w2, weights, ids, config=cfg))
            res["configs"][str(cfg)] = {"ms": round(ms, 3), "TFLOPs": round(flops / ms / 1e9, 1),
                                        "first_call_s": round(time.perf_counter() - t0, 2)}
        except Exception as exc:   # a config that does not fit (shared memory) is reported, not fatal
            res["configs"][str(cfg)] = f"error: {str(exc)[:200]}"
        print(name, tokens, cfg, res["configs"][str(cfg)], flush=True)
    return res


def sweep(run_one, default_tokens: str, default_output: str, mode: str = "") -> None:
    """Command line shared with tune_moe_pair.py: run_one(name, shape, tokens) -> dict for every shape and token
    count, written to --output after each shape. `mode`: the flag the caller took out of sys.argv (kept in the
    recorded command)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default=default_tokens)
    ap.add_argument("--output", default=default_output)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    args = ap.parse_args()
    command = " ".join(["python", sys.argv[0]] + ([mode] if mode else []) + sys.argv[1:])
    out = {"command": command, "gpu": torch.cuda.get_device_name(), "results": {}}
    for name in args.shapes.split(","):
        s = SHAPES[name]
        out["results"][name] = [run_one(name, s, int(t)) for t in args.tokens.split(",")]
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    sweep(run, "1024,8192", "tune_fused_moe.json")
