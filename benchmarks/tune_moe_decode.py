"""Aligned-mode fused MoE tiles at decode batch sizes (8-256 tokens), timed on the GPU (a tuning aid).

For each MoE shape and decode batch, `fused_moe` runs end to end (align + gate/up + down + combine) inside a CUDA
graph of 20 calls (as a decode step runs it), for the engine's pick and a grid of MoEConfig candidates. Reported:
microseconds per call and the bandwidth of the distinct experts' weights it reached (their bytes / time), against
the 4.24 TB/s copy bandwidth.

Run (GPU machine):  python benchmarks/tune_moe_decode.py --output tune_moe_decode.json
"""

from __future__ import annotations

import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepserve.kernels.fused_moe import MoEConfig, fused_moe, pick_config  # noqa: E402
from tune_fused_moe import sweep  # noqa: E402  (this folder: the shapes and the command line)
from tune_moe_pair import graph_us  # noqa: E402  (CUDA-graph replay timing)

# (block_n_up, block_n_down, block_k, num_warps, num_stages) for each block_m
TILES = [(32, 64, 128, 4, 3), (64, 64, 64, 4, 3), (64, 128, 64, 4, 4), (64, 128, 128, 4, 3), (128, 128, 64, 8, 3),
         (64, 64, 128, 4, 4), (32, 32, 256, 4, 3), (128, 64, 64, 4, 3)]
CANDIDATES = [MoEConfig(bm, *t) for bm, t in itertools.product((16, 32, 64), TILES)]


def run(name: str, s: dict, tokens: int) -> dict:
    dev = "cuda"
    e, k, h, i = s["experts"], s["top_k"], s["hidden"], s["inter"]
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, h, device=dev, dtype=torch.bfloat16, generator=gen)
    w13 = torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    w2 = torch.randn(e, h, i, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    weights, ids = torch.randn(tokens, e, device=dev, generator=gen).softmax(-1).topk(k, dim=-1)
    bytes_read = ids.unique().numel() * 3 * h * i * 2
    res = {"tokens": tokens, "weight_MB": round(bytes_read / 1e6, 1), "engine_pick": None, "configs": {}}
    res["engine_pick"] = str(pick_config(tokens * k, e, i, h, x.device))
    for label, cfg in [("engine pick", None)] + [(str(c), c) for c in CANDIDATES]:
        try:
            us = graph_us(lambda: fused_moe(x, w13, w2, weights, ids, config=cfg))
            res["configs"][label] = {"us": round(us, 2), "GBps": round(bytes_read / us / 1e3)}
        except Exception as exc:    # a config that does not compile or fit is reported, not fatal
            res["configs"][label] = f"error: {str(exc)[:200]}"
        print(name, tokens, label, res["configs"][label], flush=True)
    timed = {lbl: r["us"] for lbl, r in res["configs"].items() if isinstance(r, dict)}
    res["best"] = min(timed.items(), key=lambda kv: kv[1])
    print(name, tokens, "best", res["best"], flush=True)
    return res


if __name__ == "__main__":
    sweep(run, "64,256", "tune_moe_decode.json")
