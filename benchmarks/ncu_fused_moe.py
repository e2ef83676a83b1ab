"""The fused MoE's kernels at decode batch sizes, launched a few times for Nsight Compute (a profiling aid).

Qwen3-MoE's batch-256 step reads its experts at 96% of the copy bandwidth in the gate/up GEMM and 89% in the down
GEMM (H100, benchmarks/qwen3_b256_pdl_off_heads-first_h100_s36.json), and no down tiling moved the latter
(tune_moe_down_h100_s35.json). This runs `fused_moe` with the engine's own pick (align, gate/up, down, combine) over
random weights of each shape and a random routing, so `ncu -k regex:...` sees the launches a step makes.

Run (GPU machine, under ncu; benchmarks/gpu_pending.sh moe-ncu):
  ncu -k "regex:^(_gate_up_kernel|_down_kernel)$" python benchmarks/ncu_fused_moe.py --shapes qwen3-moe --tokens 256
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from deepserve.kernels.fused_moe import fused_moe  # noqa: E402
from tune_fused_moe import SHAPES  # noqa: E402
from tune_moe_pair import moe_inputs  # noqa: E402


def run(shape: dict, tokens: int, reps: int) -> None:
    x, w13, w2, weights, ids = moe_inputs(shape, tokens)
    for _ in range(reps):
        fused_moe(x, w13, w2, weights, ids)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen3-moe", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    for name in args.shapes.split(","):
        run(SHAPES[name], args.tokens, args.reps)


if __name__ == "__main__":
    main()
