"""Decode attention at real batch sizes on the GPU: split counts and tiles of the paged (GQA) and latent (MLA)
decode kernels, against the bandwidth of the KV bytes they must read (a tuning aid).

For each shape, batch and context: a paged cache of block size 16 with shuffled blocks, every sequence at
`context` keys; each launch setting runs inside a CUDA graph of 20 calls (as a decode step runs it) and is
reported as microseconds per call and KV TB/s (cache bytes the call reads / time). First the engine's pick,
then every split count with the default tiles, then tile variants at the best split count.

Run (GPU machine):  python benchmarks/tune_decode_attention.py --output tune_decode_attention.json
  (--kv-dtype e4m3: the paged shapes over an E4M3 cache; the MLA shape stays bf16. A PNG beside the JSON: the
  split counts' times; --plot-only redraws it.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from deepserve.kernels.mla_decode import mla_decode, mla_num_splits  # noqa: E402
from deepserve.kernels.decode_launch import SPLIT_MERGE, DecodeTiles, launch_num_splits  # noqa: E402
from deepserve.kernels.paged_attention import decode_attention  # noqa: E402
from tune_gemv import graph_time  # noqa: E402  (CUDA-graph replay timing)

BLOCK = 16
SHAPES = {   # (query heads, KV heads, head dim) for paged GQA; "mla": (heads, latent rank, rope dim)
    "qwen3-moe": ("gqa", 32, 4, 128),
    "llama-3.2-1b": ("gqa", 32, 8, 64),
    "llama-3-8b": ("gqa", 32, 8, 128),
    "deepseek-v2-lite": ("mla", 16, 512, 64),
}
SPLITS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]
GQA_TILES = [DecodeTiles(64, 4, 2, True), DecodeTiles(32, 4, 2, False), DecodeTiles(32, 4, 2, True),
             DecodeTiles(128, 4, 2, False), DecodeTiles(128, 8, 2, True), DecodeTiles(64, 8, 2, True),
             DecodeTiles(64, 4, 3, True), DecodeTiles(32, 4, 3, True), DecodeTiles(64, 4, 3, False)]
MLA_TILES = [(16, 4, 2), (32, 4, 3), (64, 4, 2), (32, 8, 2), (64, 8, 2), (16, 4, 3), (32, 4, 4)]  # (block_n, warps, stages)
# The recorded tune_decode_attention.json predates the heuristics it led to: its "default" MLA tiles were 2 stages.


def paged_inputs(batch: int, context: int, gen: torch.Generator):
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq + 1
    table = torch.randperm(num_blocks - 1, generator=gen)[:batch * blocks_per_seq].view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    return num_blocks, table.to(torch.int32).cuda(), seq_lens.cuda()


def time_us(fn) -> float:
    return graph_time(lambda _copy: fn(), 1) * 1e3


def sweep_launches(run, tiles: list, engine_splits: int, kv_bytes: int, batch: int, context: int) -> dict:
    """`run(splits, tiles)` -> us: the engine's pick, every split count with the default tiles, then each tile
    variant at the best split count."""
    res = {"batch": batch, "context": context, "kv_MB": round(kv_bytes / 1e6, 1), "engine_splits": engine_splits}
    res["engine_us"] = round(run(), 2)
    by_split = {s: run(s) for s in SPLITS}
    res["splits_us"] = {str(s): round(t, 2) for s, t in by_split.items()}
    best_split = min(by_split, key=by_split.get)
    res["tiles_us"] = {str(t): round(run(best_split, t), 2) for t in tiles}
    best = min([(by_split[best_split], f"splits {best_split} default")] +
               [(t, f"splits {best_split} {k}") for k, t in res["tiles_us"].items()])
    res["best"] = (round(best[0], 2), best[1])
    res["engine_TBps"] = round(kv_bytes / res["engine_us"] / 1e6, 3)
    res["best_TBps"] = round(kv_bytes / best[0] / 1e6, 3)
    return res


def tune_gqa(shape, batch: int, context: int, kv_dtype: torch.dtype = torch.bfloat16) -> dict:
    _, h, hkv, d = shape
    gen = torch.Generator().manual_seed(batch + context)
    num_blocks, table, seq_lens = paged_inputs(batch, context, gen)
    cache = torch.randn(2, num_blocks, BLOCK, hkv, d, dtype=torch.bfloat16, device="cuda").to(kv_dtype)
    q = torch.randn(batch, h, d, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    q_rows = torch.arange(batch, device="cuda")
    kv_bytes = batch * context * 2 * hkv * d * cache.element_size()

    def run(splits=None, tiles=None):
        return time_us(lambda: decode_attention(q, cache, table, seq_lens, 0.1, out=out, q_rows=q_rows,
                                                seq_ids=q_rows, max_seq_len=context, num_splits=splits, tiles=tiles))

    engine_splits = launch_num_splits(batch, h, cache, context, SPLIT_MERGE == "last")
    return sweep_launches(run, GQA_TILES, engine_splits, kv_bytes, batch, context)


def tune_mla(shape, batch: int, context: int) -> dict:
    _, h, rank, rope = shape
    gen = torch.Generator().manual_seed(batch + context)
    num_blocks, table, seq_lens = paged_inputs(batch, context, gen)
    cache = torch.randn(num_blocks, BLOCK, rank + rope, dtype=torch.bfloat16, device="cuda")
    q_lat = torch.randn(batch, h, rank, dtype=torch.bfloat16, device="cuda")
    q_pe = torch.randn(batch, h, rope, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q_lat)
    kv_bytes = batch * context * (rank + rope) * 2

    def run(splits=None, block_n=32, warps=None, stages=None):
        return time_us(lambda: mla_decode(q_lat, q_pe, cache, table, seq_lens, 0.1, out=out, max_seq_len=context,
                                          num_splits=splits, block_n=block_n, num_warps=warps,
                                          **({"num_stages": stages} if stages else {})))

    return sweep_launches(lambda splits=None, tiles=None: run(splits, *(tiles or ())), MLA_TILES,
                          mla_num_splits(batch, h, context, q_lat.device), kv_bytes, batch, context)


def plot(path: str) -> str:
    """The PNG beside `path`: each shape and context a panel, microseconds per call against the split count, a line
    per batch, the engine's pick marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(path) as f:
        data = json.load(f)
    panels = sorted({(name, r["context"]) for name, rows in data["results"].items() for r in rows if "splits_us" in r})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (name, context) in zip(axes[0], panels):
        for r in data["results"][name]:
            if r.get("context") != context or "splits_us" not in r:
                continue
            xs = [int(s) for s in r["splits_us"]]
            line, = ax.plot(xs, list(r["splits_us"].values()), marker=".", label=f"batch {r['batch']}")
            ax.plot([r["engine_splits"]], [r["engine_us"]], marker="o", mfc="none", ms=9, color=line.get_color())
        ax.set(xscale="log", yscale="log", xlabel="splits", title=f"{name}, {context} keys")
        ax.set_xticks(SPLITS, [str(s) for s in SPLITS])
    axes[0][0].set_ylabel("us a call (circle: the engine's pick)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"{data.get('gpu', '')}, {data.get('kv_dtype', 'bf16')} cache: {data['command'][:110]}", fontsize=7)
    fig.tight_layout()
    png = os.path.splitext(path)[0] + ".png"
    fig.savefig(png, dpi=110)
    return png


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--batches", default="8,32,64,128,256")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--output", default="tune_decode_attention.json")
    ap.add_argument("--kv-dtype", choices=("bf16", "e4m3"), default="bf16", help="the paged (GQA) cache's dtype")
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG beside --output from its JSON")
    args = ap.parse_args()
    if args.plot_only:
        print("wrote", plot(args.output))
        return
    kv_dtype = torch.float8_e4m3fn if args.kv_dtype == "e4m3" else torch.bfloat16
    out = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "kv_dtype": args.kv_dtype,
           "results": {}}
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        rows = out["results"][name] = []
        for context in [int(c) for c in args.contexts.split(",")]:
            for batch in [int(b) for b in args.batches.split(",")]:
                try:
                    rows.append(tune_mla(shape, batch, context) if shape[0] == "mla"
                                else tune_gqa(shape, batch, context, kv_dtype))
                except Exception as exc:      # a setting that does not compile or fit is reported, not fatal
                    rows.append({"batch": batch, "context": context, "error": str(exc)[:300]})
                r = rows[-1]
                print(name, batch, context, {k: r.get(k) for k in ("engine_splits", "engine_us", "engine_TBps",
                                                                    "best", "best_TBps", "error")}, flush=True)
                torch.cuda.empty_cache()
                with open(args.output, "w") as f:
                    json.dump(out, f, indent=1)
    try:
        print("wrote", plot(args.output))
    except ImportError:
        print("no matplotlib: no PNG")


if __name__ == "__main__":
    main()
