"""Decode-size fused MoE on the GPU: pair mode's tiles against each other and against the aligned mode (a tuning aid).

For each MoE shape and decode batch (tokens), `fused_moe` runs end to end (experts + combine) inside a CUDA graph
(20 calls per replay, as a decode step runs it), for: the engine's pick, the aligned mode's heuristic tiles, and a
grid of MoEPairConfig candidates. Reported: microseconds per call and the weight bandwidth it reached (bytes of
the distinct experts the step reads / time).

Run (GPU machine):  python benchmarks/tune_moe_pair.py --output tune_moe_pair.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepserve.kernels.fused_moe import MoEPairConfig, fused_moe, pick_config  # noqa: E402

SHAPES = {"deepseek-v2-lite": dict(experts=64, top_k=6, hidden=2048, inter=1408),
          "qwen3-moe": dict(experts=128, top_k=8, hidden=2048, inter=768)}
TILES = [(4, 8), (8, 16), (16, 32), (32, 64)]                # (block_n_up, block_n_down)
K_WARPS = [(128, 4), (256, 4), (512, 4), (256, 8), (512, 8), (128, 2), (256, 2)]
CANDIDATES = [MoEPairConfig(n_up, n_down, bk, w) for (bk, w), (n_up, n_down) in itertools.product(K_WARPS, TILES)]
CALLS_PER_GRAPH = 20


def graph_us(fn) -> float:
    """Microseconds per call of `fn`, replayed from a CUDA graph of CALLS_PER_GRAPH calls."""
    fn()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(CALLS_PER_GRAPH):
                fn()
    torch.cuda.synchronize()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (10 * CALLS_PER_GRAPH)


def run(name: str, s: dict, tokens: int) -> dict:
    dev = "cuda"
    e, k, h, i = s["experts"], s["top_k"], s["hidden"], s["inter"]
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(tokens, h, device=dev, dtype=torch.bfloat16, generator=gen)
    w13 = torch.randn(e, 2 * i, h, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    w2 = torch.randn(e, h, i, device=dev, dtype=torch.bfloat16, generator=gen) * 0.02
    weights, ids = torch.randn(tokens, e, device=dev, generator=gen).softmax(-1).topk(k, dim=-1)
    bytes_read = ids.unique().numel() * 3 * h * i * 2
    res = {"tokens": tokens, "weight_MB": round(bytes_read / 1e6, 1), "configs": {}}
    aligned = pick_config(tokens * k, e, i, h, x.device)
    for label, cfg in [("engine pick", None), ("aligned " + str(aligned), aligned)] + [(str(c), c) for c in CANDIDATES]:
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--output", default="tune_moe_pair.json")
    args = ap.parse_args()
    out = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "results": {}}
    for name, s in SHAPES.items():
        out["results"][name] = [run(name, s, int(t)) for t in args.tokens.split(",")]
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
