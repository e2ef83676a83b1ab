"""What a sliding window saves the GPU's paged attention kernels: one layer of Mistral-7B-v0.1's attention (32 query
heads, 8 KV heads of 128, a 4096-key window, bf16 cache in 16-slot blocks), with and without the window.

Decode: batch 1 / 8 / 32 at 4k and 16k keys of context; a windowed row reads its last 4096 keys, so at 16k it should
cost what a 4k context costs. Prefill: one sequence's whole prompt of 4k / 16k tokens, where the window bounds each
query's keys (the kernel skips the tiles before a query tile's window). Each call timed with CUDA events over a CUDA
graph of repeated launches (median of 5 replays), after a warm-up; the bytes a decode reads (its KV, window-bounded)
over its time give TB/s.

    python benchmarks/sliding_window_attention.py --output benchmarks/sliding_window_attention_h100.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from deepserve.kernels.paged_attention import decode_attention
from deepserve.kernels.paged_prefill import prefill_attention, prefill_tiles

HEADS, KV_HEADS, HEAD_DIM, BLOCK, WINDOW = 32, 8, 128, 16, 4096


def cache_and_tables(batch: int, context: int, device: str):
    blocks = -(-context // BLOCK)
    cache = torch.randn(2, batch * blocks + 1, BLOCK, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    tables = torch.randperm(batch * blocks, device=device).view(batch, blocks).to(torch.int32)
    return cache, tables


def time_us(fn, rounds: int = 5, calls: int = 50) -> float:
    """us per call of `fn`, `calls` launches captured in one CUDA graph and replayed (a small call is shorter than
    its host-side launch: timed back to back without a graph, the host would be what is measured)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def decode_case(batch: int, context: int, window: int, device: str) -> dict:
    cache, tables = cache_and_tables(batch, context, device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    us = time_us(lambda: decode_attention(q, cache, tables, lens, HEAD_DIM ** -0.5, out=out, max_seq_len=context,
                                          window=window))
    keys = min(context, window) if window else context
    nbytes = batch * keys * 2 * KV_HEADS * HEAD_DIM * 2
    return {"kind": "decode", "batch": batch, "context": context, "window": window, "us": round(us, 2),
            "kv_bytes": nbytes, "TBps": round(nbytes / us / 1e6, 3)}


def prefill_case(context: int, window: int, device: str) -> dict:
    cache, tables = cache_and_tables(1, context, device)
    lens = torch.tensor([context], device=device)
    starts = torch.tensor([0, context], device=device)
    q = torch.randn(context, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    tile_seq, tile_m0 = prefill_tiles([context], [0], torch.device(device))
    us = time_us(lambda: prefill_attention(q, cache, tables, lens, starts, HEAD_DIM ** -0.5, tile_seq, tile_m0,
                                           out=out, window=window), calls=5)
    return {"kind": "prefill", "batch": 1, "context": context, "window": window, "us": round(us, 1)}


def plot(payload: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = payload["results"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kind in zip(axes, ("decode", "prefill")):
        cases = sorted({(r["batch"], r["context"]) for r in rows if r["kind"] == kind})
        x = range(len(cases))
        for offset, window in ((-0.2, 0), (0.2, WINDOW)):
            ys = [next(r["us"] for r in rows if r["kind"] == kind and (r["batch"], r["context"]) == c
                       and r["window"] == window) for c in cases]
            ax.bar([i + offset for i in x], ys, width=0.4, label=f"window {window or 'none'}")
        ax.set_xticks(list(x), [f"b{b} {c // 1024}k" for b, c in cases])
        ax.set_ylabel("us per call")
        ax.set_title(f"{kind}, one Mistral-7B layer")
        ax.legend()
    fig.suptitle(payload.get("gpu", ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True)
    parser.add_argument("--plot-only", action="store_true", help="redraw the PNG of an existing --output")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.load(open(args.output)), args.output.removesuffix(".json") + ".png")
        return
    device = "cuda"
    results = []
    for batch in (1, 8, 32):
        for context in (4096, 16384):
            for window in (0, WINDOW):
                results.append(decode_case(batch, context, window, device))
                print(results[-1], flush=True)
    for context in (4096, 16384):
        for window in (0, WINDOW):
            results.append(prefill_case(context, window, device))
            print(results[-1], flush=True)
    payload = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
               "torch": torch.__version__,
               "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK,
                         "window": WINDOW, "cache_dtype": "bfloat16"}, "results": results}
    with open(args.output, "w") as f:
        json.dump(payload, f, indent=1)
    plot(payload, args.output.removesuffix(".json") + ".png")


if __name__ == "__main__":
    main()
