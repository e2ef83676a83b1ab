"""Decode-size fused MoE on the GPU: pair mode's tiles against each other and against the aligned mode (a tuning aid).

For each MoE shape and decode batch (tokens), `fused_moe` runs end to end (experts + combine) inside a CUDA graph
(20 calls per replay, as a decode step runs it), for: the engine's pick, the aligned mode's heuristic tiles, and a
grid of MoEPairConfig candidates. Reported: microseconds per call and the weight bandwidth it reached (bytes of
the distinct experts the step reads / time).

Run (GPU machine):  python benchmarks/tune_moe_pair.py --output tune_moe_pair.json
"""

from __future__ import annotations

import itertools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepserve.kernels.fused_moe import MoEPairConfig, fused_moe, pick_config  # noqa: E402
from tune_fused_moe import sweep  # noqa: E402  (this folder: the shapes and the command line)
from tune_gemv import graph_time  # noqa: E402  (CUDA-graph replay timing)

TILES = [(4, 8), (8, 16), (16, 32), (32, 64), (8, 32), (8, 64), (16, 16)]    # (block_n_up, block_n_down)
K_WARPS = [(128, 4), (256, 4), (512, 4), (256, 8), (512, 8), (128, 2), (256, 2)]
CANDIDATES = [MoEPairConfig(n_up, n_down, bk, w) for (bk, w), (n_up, n_down) in itertools.product(K_WARPS, TILES)]

def graph_us(fn) -> float:
    """Microseconds per call of `fn`, replayed from a CUDA graph of 20 calls (as a decode step runs it)."""
    return graph_time(lambda _copy: fn(), 1) * 1e3

def run(name: str, s: dict, tokens: int) -> dict:
    aligned = pick_config(tokens * s["top_k"], s["experts"], s["inter"], s["hidden"], torch.device("cuda"))
    return time_configs(name, s, tokens, [("engine pick", None), ("aligned " + str(aligned), aligned)] +
                        [(str(c), c) for c in CANDIDATES])


def moe_inputs(s: dict, tokens: int, dev: str = "cuda") -> tuple[torch.Tensor, ...]:
    """(x, w13, w2, router weights, expert ids): random bf16 tokens and expert weights of shape `s`, a random
    top-k routing (seeded: the same every call)."""
    e, k, h, i = s["experts"], s["top_k"], s["hidden"], s["inter"]
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, h, device=dev, dtype=torch.bfloat16, generator=gen)
    w13 = torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    w2 = torch.randn(e, h, i, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    weights, ids = torch.randn(tokens, e, device=dev, generator=gen).softmax(-1).topk(k, dim=-1)
    return x, w13, w2, weights, ids


def time_configs(name: str, s: dict, tokens: int, configs: list) -> dict:
    """fused_moe at `tokens` random tokens for each (label, config) of `configs` (None: the engine's pick)."""
    h, i = s["hidden"], s["inter"]
    x, w13, w2, weights, ids = moe_inputs(s, tokens)
    bytes_read = ids.unique().numel() * 3 * h * i * 2
    res = {"tokens": tokens, "weight_MB": round(bytes_read / 1e6, 1), "configs": {}}
    for label, cfg in configs:
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
    sweep(run, "1,4", "tune_moe_pair.json")
