"""Batch-1 decode's fused qkv GEMV + rotary + KV write (kernels/qkv_rotary.py) at its launch settings: rotation pairs
and warps a program (qkv_rotary_write's `tiles`), against the plain GEMV of the same weight at gemv_config's tiles
(no rotation, no cache write: what the weight's bytes cost alone) and the weight's bytes at the copy bandwidth.

Why: on an H100 with PDL off (split_merge_timeline_last_pdl0_h100_s42.json) Llama-3.2-1B's fused launch took 7.6 us
a layer for its 12.6 MB of weight (1.65 TB/s, 55% of the copy bandwidth) with two rows a program, where the plain
GEMV of such weights takes four rows a program and four warps.

Each setting runs in a CUDA graph of 20 calls cycling over 8 copies of the weight (past L2), PDL-launched as in a
step, with the layer's RMSNorm (in the prologue where one K step holds the row, else the norm kernel first).

Run (GPU machine): python benchmarks/tune_qkv_rotary.py --output benchmarks/tune_qkv_rotary.json  (+ PNG beside it;
  --plot-only redraws it)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from deepserve.kernels.qkv_rotary import qkv_rotary_write  # noqa: E402
from deepserve.kernels.gemv import gemv  # noqa: E402
from deepserve.layers.rotary import RotaryEmbedding  # noqa: E402
from tune_gemv import graph_time  # noqa: E402  (CUDA-graph replay timing)

SHAPES = {   # hidden, query heads, KV heads, head_dim
    "llama-3.2-1b": (2048, 32, 8, 64),
    "qwen3-moe": (2048, 32, 4, 128),
    "llama-3-8b": (4096, 32, 8, 128),
}
TILES = ["1x2", "1x4", "2x2", "2x4", "4x4", "4x8", "8x4", "8x8", "16x8"]
COPIES = 8


class Norm(torch.nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden, dtype=torch.bfloat16, device="cuda"), requires_grad=False)
        self.eps = 1e-6


def tune_shape(hidden: int, heads: int, kv_heads: int, d: int) -> dict:
    n = (heads + 2 * kv_heads) * d
    weights = [(torch.randn(n, hidden, device="cuda") * hidden ** -0.5).to(torch.bfloat16) for _ in range(COPIES)]
    x = torch.randn(1, hidden, device="cuda").to(torch.bfloat16)
    norm = Norm(hidden)
    rot = RotaryEmbedding(d, 4096, 10000.0)
    cos, sin = rot.cos_cache.cuda(), rot.sin_cache.cuda()
    cache = torch.zeros(2, 64, 16, kv_heads, d, dtype=torch.bfloat16, device="cuda")
    positions, slots = torch.tensor([1000], device="cuda"), torch.tensor([77], device="cuda")
    weight_bytes = n * hidden * 2
    res = {"rows": n, "hidden": hidden, "weight_MB": round(weight_bytes / 1e6, 2), "us": {}, "TBps": {}}

    def record(name, fn):
        us = graph_time(fn, COPIES) * 1e3
        res["us"][name] = round(us, 2)
        res["TBps"][name] = round(weight_bytes / us / 1e6, 3)

    for text in TILES:
        tiles = tuple(int(v) for v in text.split("x"))        # rotation pairs x warps
        record(text, lambda c: qkv_rotary_write(x, weights[c], None, cache, slots, positions, cos, sin, heads,
                                                kv_heads, norm=norm, tiles=tiles))
    record("plain GEMV", lambda c: gemv(x, weights[c]))
    best = min(TILES, key=lambda t: res["us"][t])
    res["best"] = (best, res["us"][best])
    return res


def plot(path: str) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(path) as f:
        data = json.load(f)
    shapes = list(data["results"])
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.6 * len(shapes), 3.6), squeeze=False)
    for ax, name in zip(axes[0], shapes):
        r = data["results"][name]
        names = list(r["TBps"])
        ax.bar(range(len(names)), [r["TBps"][k] for k in names],
               color=["tab:gray" if k == "plain GEMV" else "tab:blue" for k in names])
        ax.set_xticks(range(len(names)), names, rotation=60, fontsize=7)
        ax.set(title=f"{name}: {r['rows']} x {r['hidden']}", ylabel="weight TB/s")
        if data.get("copy_bandwidth_TBps"):
            ax.axhline(data["copy_bandwidth_TBps"], color="k", lw=0.8, ls="--")
    fig.suptitle(f"{data['gpu']}: fused qkv + rotary + KV write, pairs x warps a program (dashed: copy bandwidth)",
                 fontsize=8)
    fig.tight_layout()
    png = os.path.splitext(path)[0] + ".png"
    fig.savefig(png, dpi=110)
    return png


def copy_bandwidth_tbps() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    for _ in range(5):
        b.copy_(a)
    ev1.record()
    torch.cuda.synchronize()
    return round(2 * a.numel() * 5 / (ev0.elapsed_time(ev1) * 1e-3) / 1e12, 3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--output", default="tune_qkv_rotary.json")
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    if args.plot_only:
        print("wrote", plot(args.output))
        return
    out = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
           "copy_bandwidth_TBps": copy_bandwidth_tbps(), "results": {}}
    for name in args.shapes.split(","):
        out["results"][name] = r = tune_shape(*SHAPES[name])
        print(name, r["best"], r["us"], flush=True)
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1)
    try:
        print("wrote", plot(args.output))
    except ImportError:
        print("no matplotlib: no PNG")


if __name__ == "__main__":
    main()
