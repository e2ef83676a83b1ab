"""Aligned-mode fused MoE tiles at decode batch sizes (8-256 tokens), timed on the GPU (a tuning aid).

For each MoE shape and decode batch, `fused_moe` runs end to end (align + gate/up + down + combine) inside a CUDA
graph of 20 calls (as a decode step runs it), for the engine's pick and a grid of MoEConfig candidates. Reported:
microseconds per call and the bandwidth of the distinct experts' weights it reached (their bytes / time; compare it
with the card's copy bandwidth, e.g. h200_dense.py's, 4.24 TB/s on an H200 and 3.02 on an H100).

Run (GPU machine):  python benchmarks/tune_moe_decode.py --output tune_moe_decode.json
  --down: the engine's pick with only the down GEMM's tiles varied (DOWN_TILES), at 64 / 128 / 256 tokens:
    python benchmarks/tune_moe_decode.py --down --shapes deepseek-v2-lite,qwen3-moe --output tune_moe_down.json
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepserve.kernels.fused_moe import MoEConfig, pick_config  # noqa: E402
from tune_fused_moe import sweep  # noqa: E402  (this folder: the shapes and the command line)
from tune_moe_pair import time_configs  # noqa: E402  (CUDA-graph timing of each config)

# (block_n_up, block_n_down, block_k, num_warps, num_stages) for each block_m
TILES = [(32, 64, 128, 4, 3), (64, 64, 64, 4, 3), (64, 128, 64, 4, 4), (64, 128, 128, 4, 3), (128, 128, 64, 8, 3),
         (64, 64, 128, 4, 4), (32, 32, 256, 4, 3), (128, 64, 64, 4, 3)]
CANDIDATES = [MoEConfig(bm, *t) for bm, t in itertools.product((16, 32, 64), TILES)]


# --down: the engine's pick with the down GEMM's tiles replaced: (block_n_down, block_k_down, warps, stages). Session
# 48 moved the grid to 128- / 256-wide N tiles and 64- / 128-wide K steps (fewer, longer programs; two an SM where
# shared memory allows); session 35's had 64 / 128 and 128 / 256 (tune_moe_down_h100_s35.json).
DOWN_TILES = list(itertools.product((128, 256), (64, 128), (4, 8), (3, 4)))


def run_down(name: str, s: dict, tokens: int) -> dict:
    pick = pick_config(tokens * s["top_k"], s["experts"], s["inter"], s["hidden"], torch.device("cuda"))
    res = time_configs(name, s, tokens, [("engine pick", None)] + down_candidates(pick))
    res["engine_pick"] = str(pick)
    return res


def down_candidates(pick: MoEConfig) -> list:
    return [(str(c), c) for c in (dataclasses.replace(pick, block_n_down=n, block_k_down=k, num_warps_down=w,
                                                      num_stages_down=st) for n, k, w, st in DOWN_TILES)]


def run(name: str, s: dict, tokens: int) -> dict:
    pick = pick_config(tokens * s["top_k"], s["experts"], s["inter"], s["hidden"], torch.device("cuda"))
    res = time_configs(name, s, tokens, [("engine pick", None)] + [(str(c), c) for c in CANDIDATES])
    res["engine_pick"] = str(pick)
    return res


if __name__ == "__main__":
    if "--down" in sys.argv:
        sys.argv.remove("--down")
        sweep(run_down, "64,128,256", "tune_moe_down.json", mode="--down")
    else:
        sweep(run, "64,256", "tune_moe_decode.json")
