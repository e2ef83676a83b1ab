"""Decode GEMMs of a few rows (M = 2..16; 32 and 64 to see where cuBLAS takes over): cuBLAS (F.linear) against the
skinny GEMM of deepserve/kernels/skinny_gemm.py over a grid of tilings, on the linear shapes of Llama-3.2-1B,
Llama-3-8B, DeepSeek-V2-Lite (MLA projections, shared experts, the dense first layer, the LM head) and Qwen3-30B-A3B
(attention). SwiGLU shapes (gate/up) also time the fused mode against cuBLAS + the SiLU-and-mul kernel, the two
launches it replaces.

`engine` is the tiling `skinny_tiles` picks (what the engine runs), `engine_prefetchP` the same with another PDL
prefetch mode; --grid-rows M times a grid of tilings too (tune_skinny_gemm_grid.json: M = 8 and 32).

--splits 1,2,4,8 times each tiling of the grid at those split-K part counts (tune_skinny_split_h200.json).

Times are CUDA-graph replays of 20 back-to-back calls, L2-cold weights (the calls cycle over copies whose total is
beyond L2); GB/s counts the weight bytes.

Run (GPU machine):  python benchmarks/tune_skinny_gemm.py --output benchmarks/tune_skinny_gemm.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from deepserve.kernels.activation import silu_and_mul  # noqa: E402
from deepserve.kernels.skinny_gemm import SkinnyTiles, skinny_linear, skinny_swiglu, skinny_tiles  # noqa: E402
from tune_gemv import graph_time  # noqa: E402  (CUDA-graph replay timing)

# name -> (N, K, swiglu)
SHAPES = {
    "1b_qkv": (3072, 2048, False), "1b_o": (2048, 2048, False), "1b_gate_up": (16384, 2048, True),
    "1b_down": (2048, 8192, False),
    "8b_qkv": (6144, 4096, False), "8b_o": (4096, 4096, False), "8b_gate_up": (28672, 4096, True),
    "8b_down": (4096, 14336, False),
    "v2lite_q": (3072, 2048, False), "v2lite_kv_a": (576, 2048, False), "v2lite_o": (2048, 2048, False),
    "v2lite_shared_gate_up": (5632, 2048, True), "v2lite_shared_down": (2048, 2816, False),
    "v2lite_dense_gate_up": (21888, 2048, True), "v2lite_dense_down": (2048, 10944, False),
    "qwen3moe_qkv": (5120, 2048, False), "qwen3moe_o": (2048, 4096, False),
    "1b_lm_head": (128256, 2048, False), "v2lite_lm_head": (102400, 2048, False), "8b_lm_head": (128256, 4096, False),
}
GRID = [SkinnyTiles(bn, bk, w, s) for bn, bk, (w, s) in
        itertools.product((16, 32, 64), (128, 256, 512), ((4, 3), (4, 4), (8, 4)))]
# (the grid's first sweep: --grid-rows 8,32, written to benchmarks/tune_skinny_gemm_grid.json)


def time_us(fn, copies: int) -> float:
    return round(graph_time(fn, copies) * 1e3, 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", default="benchmarks/tune_skinny_gemm.json")
    ap.add_argument("--rows", default="2,4,8,16,32,64")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--grid-rows", default="", help="row counts that time the whole grid (others: engine only)")
    ap.add_argument("--grid", default="",
                    help="the grid's tilings instead of GRID: bn:bk:warps:stages[:prefetch[:split_k]],...")
    ap.add_argument("--splits", default="1", help="split-K part counts; the grid is timed at each")
    args = ap.parse_args()
    grid = ([SkinnyTiles(*map(int, t.split(":"))) for t in args.grid.split(",")] if args.grid else GRID)
    grid = [t._replace(split_k=int(s)) if int(s) > 1 else t for t in grid for s in args.splits.split(",")]
    rows_list = [int(r) for r in args.rows.split(",")]
    grid_rows = {int(r) for r in args.grid_rows.split(",") if r}
    out = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "results": {}}
    for name in args.shapes.split(","):
        n, k, swiglu = SHAPES[name]
        copies = max(1, min(8, (200 << 20) // (n * k * 2)))       # > L2 (50 MB) in total
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        weight_bytes = n * k * 2
        shape_out = {"n": n, "k": k, "swiglu": swiglu, "bytes": weight_bytes}
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {}
            ms = graph_time(lambda c: F.linear(x, ws[c]), copies)
            row["cublas"] = {"us": round(ms * 1e3, 2), "GBps": round(weight_bytes / ms / 1e6)}
            if swiglu:
                row["cublas_silu"] = {"us": time_us(lambda c: silu_and_mul(F.linear(x, ws[c])), copies)}
            ref = (silu_and_mul(F.linear(x, ws[0])) if swiglu else F.linear(x, ws[0])).float()
            run = skinny_swiglu if swiglu else skinny_linear
            tiles = skinny_tiles(n, k)
            configs = [("engine", tiles)] + [(f"engine_prefetch{p}", tiles._replace(prefetch=p))
                                             for p in (0, 1, 2) if p != tiles.prefetch]
            if m in grid_rows:
                configs += [(str(tuple(t)), t) for t in grid]
            for label, tiles in configs:
                try:
                    err = (run(x, ws[0], tiles=tiles).float() - ref).abs().max().item()
                    ms = graph_time(lambda c: run(x, ws[c], tiles=tiles), copies)
                    row[label] = {"us": round(ms * 1e3, 2), "GBps": round(weight_bytes / ms / 1e6),
                                  "max_err": round(err, 5)}
                except Exception as exc:          # a tiling that does not compile (registers, shared memory)
                    row[label] = f"error: {str(exc)[:120]}"
            timed = [(v["us"], c) for c, v in row.items() if isinstance(v, dict) and c not in ("cublas", "cublas_silu")]
            row["best"] = min(timed) if timed else None
            base = row["cublas_silu"]["us"] if swiglu else row["cublas"]["us"]
            row["engine_vs_cublas"] = round(base / row["engine"]["us"], 3) if isinstance(row["engine"], dict) else None
            print(name, m, "cublas", row["cublas"], "engine", row["engine"], "best", row["best"], flush=True)
            shape_out[str(m)] = row
        out["results"][name] = shape_out
        del ws
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
