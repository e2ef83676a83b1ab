"""The MoE align (pairs grouped by expert, runs padded to block_m) on the GPU, against the align as it was before
(`--before`, a copy of an older deepserve/kernels/moe_align.py, or of fused_moe.py from before session 24, where
the align lived), in the same run: microseconds per call inside a CUDA graph of 20 calls, for DeepSeek-V2-Lite's
routing (6 of 64 experts) and Qwen3-MoE's (8 of 128) at decode token counts, block_m as the engine picks it
(pick_moe_config). same_layout: the same expert for every block and the same pairs in every expert's run (in any
order: atomic ranks order a run as they come, so which of its blocks a pair lands in may differ).

Run (GPU machine):
  git show <rev>:deepserve/kernels/fused_moe.py > /tmp/fused_moe_before.py
  python benchmarks/moe_align_ab.py --before /tmp/fused_moe_before.py --output moe_align_ab.json
  python benchmarks/moe_align_ab.py --before /tmp/fused_moe_before.py --tokens 32,64,128,256,512 \
      --output moe_align_single_ab_h200.json          (session 24: the one-program align with atomics)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from deepserve.kernels.fused_moe import MoEConfig, pick_moe_config  # noqa: E402
from deepserve.kernels.moe_align import moe_align  # noqa: E402
from tune_gemv import graph_time  # noqa: E402

# name: (top_k, experts, moe intermediate size, hidden size)
SHAPES = {"deepseek-v2-lite": (6, 64, 1408, 2048), "qwen3-moe": (8, 128, 768, 2048)}


def _runs(align) -> torch.Tensor:
    """Each used row as (its block's expert, its pair), sorted: the layout up to the order inside an expert's run."""
    used = int((align.block_expert >= 0).sum())
    experts = align.block_expert[:used].long().repeat_interleave(align.block_m)
    return ((experts << 32) + align.sorted_pairs[:used * align.block_m].long()).sort().values


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4,8,12,16,32,64,128")
    ap.add_argument("--before", required=True, help="path of an older fused_moe.py")
    ap.add_argument("--output", default="moe_align_ab.json")
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("fused_moe_before", args.before)
    before = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = before          # its dataclasses look their module up there
    spec.loader.exec_module(before)
    out = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "results": {}}
    for name, (top_k, experts, inter, hidden) in SHAPES.items():
        rows = out["results"][name] = []
        for tokens in [int(t) for t in args.tokens.split(",")]:
            cfg = pick_moe_config(tokens, top_k, experts, inter, hidden, torch.bfloat16, torch.device("cuda"))
            if not isinstance(cfg, MoEConfig):      # the pair mode: no align
                continue
            gen = torch.Generator(device="cuda").manual_seed(tokens)
            ids = torch.stack([torch.randperm(experts, device="cuda", generator=gen)[:top_k] for _ in range(tokens)])
            new, old = moe_align(ids, experts, cfg.block_m), before.moe_align(ids, experts, cfg.block_m)
            # Rows of the blocks past every run are never written (nor read): compare the others.
            same = torch.equal(new.block_expert, old.block_expert) and torch.equal(_runs(new), _runs(old))
            row = {"tokens": tokens, "block_m": cfg.block_m, "same_layout": bool(same),
                   "after_us": round(graph_time(lambda _c: moe_align(ids, experts, cfg.block_m), 1) * 1e3, 2),
                   "before_us": round(graph_time(lambda _c: before.moe_align(ids, experts, cfg.block_m), 1) * 1e3,
                                      2)}
            rows.append(row)
            print(name, row, flush=True)
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
