"""The MoE router's gate GEMM + routing at 17-512 tokens on the GPU: the split-K Triton kernel feeding the routing
kernel (two launches) against cuBLAS (x cast to the gate's dtype, the GEMM, cuBLAS's split-K reduce where it picks
one, the float32 cast, then the routing kernel). Each path runs 20 times inside a CUDA graph (as a decode step
runs it); microseconds per call. Shapes: DeepSeek-V2-Lite's gate (64 experts, float32 weight, softmax top-6)
and Qwen3-MoE's (128 experts, bf16 weight, softmax top-8), hidden 2048, bf16 activations.
Columns: triton_us (the engine's pick: for bf16 x on a float32 gate, the tensor-core tiles), fma_us (the split-K
kernel on CUDA cores, the float32-x tiles, at every size: the path before session 22), cublas_us.

Run (GPU machine):  python benchmarks/router_gate_ab.py --output benchmarks/router_gate_ab_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import deepserve.kernels.moe_routing as moe_routing  # noqa: E402
from deepserve.layers.moe import Router, RoutingConfig  # noqa: E402
from tune_gemv import graph_time  # noqa: E402  (CUDA-graph replay timing)

SHAPES = {
    "deepseek-v2-lite": (64, torch.float32, RoutingConfig(top_k=6)),
    "qwen3-moe": (128, torch.bfloat16, RoutingConfig(top_k=8, renormalize=True)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="17,32,64,128,256,512")
    ap.add_argument("--output", default="benchmarks/router_gate_ab_h200.json")
    args = ap.parse_args()
    supported = moe_routing.router_logit_partials_supported
    tiles = moe_routing.router_tiles
    results = {}
    for name, (experts, dtype, cfg) in SHAPES.items():
        router = Router(2048, experts, cfg, dtype).cuda()
        torch.nn.init.normal_(router.weight, 0.0, 0.02)
        load = torch.zeros(experts, dtype=torch.int64, device="cuda")
        rows = []
        for t in map(int, args.tokens.split(",")):
            x = torch.randn(t, 2048, device="cuda", dtype=torch.bfloat16)
            row = {"tokens": t}
            fma = (lambda x, w: w.dtype == torch.float32 and x.shape[0] > moe_routing.ROUTER_GEMV_MAX_TOKENS)
            for label, pick in (("triton_us", supported), ("fma_us", fma), ("cublas_us", lambda x, w: False)):
                if label == "fma_us" and dtype != torch.float32:
                    continue
                moe_routing.router_logit_partials_supported = pick
                moe_routing.router_tiles = tiles if label != "fma_us" else (lambda x, w: moe_routing.FMA_TILES)
                with torch.inference_mode():
                    row[label] = round(graph_time(lambda _copy: router(x, load), 1) * 1e3, 2)
            moe_routing.router_logit_partials_supported = supported
            moe_routing.router_tiles = tiles
            with torch.inference_mode():
                ids_new = router(x)[1]
                moe_routing.router_logit_partials_supported = lambda x, w: False
                ids_old = router(x)[1]
                moe_routing.router_logit_partials_supported = supported
            row["same_ids"] = bool(torch.equal(ids_new, ids_old))
            row["speedup"] = round(row["cublas_us"] / row["triton_us"], 2)
            print(name, row, flush=True)
            rows.append(row)
        results[name] = rows
    out = {"command": "python benchmarks/router_gate_ab.py " + " ".join(sys.argv[1:]),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
