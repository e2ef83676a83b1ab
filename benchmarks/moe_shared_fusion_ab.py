"""The shared experts inside the MoE grouped GEMMs, against their own launches, on the GPU (an A/B).

For each shape and decode batch, TritonMoE runs a whole MoE layer's experts (routed + shared, combine included)
inside a CUDA graph (20 calls per replay, as a decode step runs it) with DEEPSERVE_MOE_FUSED_SHARED on (the shared
experts as the first blocks of the aligned mode's two GEMMs) and off (their GatedMLP module first: skinny GEMMs up
to 16 tokens, cuBLAS above, then the routed experts). Random bf16 weights, random routing. Batches in the pair
mode (a few tokens) run the module either way and are left out. Reported: microseconds per call.
--uncapped: the fused runs at every batch (the engine's cap, layers/moe_triton.fused_shared_max_tokens, lifted).
(moe_shared_blocks_ab_h200.json came from session 24's variant with taller shared token blocks, up to 64 rows, as
fused_us, against the engine's as fused_s23_us; the variant lost and was removed.)

Run (GPU machine):  python benchmarks/moe_shared_fusion_ab.py --output benchmarks/moe_shared_fusion_ab_h200.json
  python benchmarks/moe_shared_fusion_ab.py --uncapped --batches 32,64,128,256 --output /tmp/uncapped.json
  python benchmarks/moe_shared_fusion_ab.py --uncapped --shapes deepseek-v2-lite --batches 128,256 --output x.json
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

import deepserve.layers.moe_triton as moe_triton  # noqa: E402
from deepserve.kernels.fused_moe import use_pair_mode  # noqa: E402
from deepserve.layers.mlp import GatedMLP  # noqa: E402
from deepserve.layers.moe_triton import TritonMoE  # noqa: E402
from tune_gemv import graph_time  # noqa: E402  (CUDA-graph replay timing)

SHAPES = {   # experts, top-k, hidden, expert intermediate, shared intermediate (n_shared x I)
    "deepseek-v2-lite": (64, 6, 2048, 1408, 2 * 1408),
    "deepseek-v3": (256, 8, 7168, 2048, 2048),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="8,16,32,64,128,256")
    ap.add_argument("--output", default="benchmarks/moe_shared_fusion_ab_h200.json")
    ap.add_argument("--uncapped", action="store_true", help="fuse at every batch, past the engine's cap")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    args = ap.parse_args()
    if args.uncapped:
        moe_triton.fused_shared_max_tokens = lambda gate_up: 1 << 30
    dev = "cuda"
    results = {}
    for name in args.shapes.split(","):
        e, k, h, i, s = SHAPES[name]
        gen = torch.Generator(device=dev).manual_seed(0)
        w13 = torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
        w2 = torch.randn(e, h, i, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
        shared = GatedMLP(h, s).to(dev).to(torch.bfloat16)
        backend = TritonMoE()
        rows = []
        for t in map(int, args.batches.split(",")):
            if use_pair_mode(t * k, e):
                continue
            x = torch.randn(t, h, device=dev, dtype=torch.bfloat16, generator=gen)
            weights, ids = torch.randn(t, e, device=dev, generator=gen).softmax(-1).topk(k, dim=-1)
            row = {"tokens": t}
            for label, flag in (("fused_us", "1"), ("module_us", "0")):
                os.environ["DEEPSERVE_MOE_FUSED_SHARED"] = flag
                with torch.inference_mode():
                    run = lambda _copy: backend.forward(x, w13, w2, weights, ids, shared_experts=shared)  # noqa: E731
                    row[label] = round(graph_time(run, 1) * 1e3, 2)
            row["saved_us"] = round(row["module_us"] - row["fused_us"], 2)
            print(name, row, flush=True)
            rows.append(row)
        results[name] = rows
        del w13, w2
        torch.cuda.empty_cache()
    os.environ.pop("DEEPSERVE_MOE_FUSED_SHARED", None)
    out = {"command": "python benchmarks/moe_shared_fusion_ab.py " + " ".join(sys.argv[1:]),
           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
