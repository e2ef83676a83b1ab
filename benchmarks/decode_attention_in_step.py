"""Paged GQA decode attention timed as a decode step runs it (a tuning aid beside tune_decode_attention.py).

tune_decode_attention.py times 20 back-to-back calls over shuffled blocks. In a decode step the kernel runs once a
layer between weight GEMMs, over the blocks the engine handed out (runs of consecutive ids), at a context that is
rarely a multiple of the key tile, and there it took ~20% longer at 512 programs of 128-wide heads (Llama-3-8B
batch 64 and Qwen3-MoE batch 128 at 1k: 91-92 us a layer in the step, 74.6 / 74.3 us in the tuning loop). The cause
was none of those surroundings but the step's int64 inputs (decode_attention_engine_inputs.py); this script passes
int32 ones, as the engine now does from 16 decode rows.

This script recreates the step's surroundings: each call sits between two GEMMs of an MLP-sized weight (a 28672 x
4096 bf16 weight, 235 MB: L2 flushed, the GPU as busy as in a step), blocks in consecutive runs per sequence (or
shuffled: --layout), `context` + 22 keys per sequence. --layers L --pool-gb G --weights W: a cache per layer sized
as the engine sizes them, and W distinct weights (the step's memory footprint). Reported per case: the decode
kernel's own time (torch profiler, kernel durations; run with DEEPSERVE_PDL=0 so that a duration is the kernel's
alone) and the split reduce's, for each (splits, tiles) candidate, and the KV bandwidth of the best.

Run (GPU machine):  DEEPSERVE_PDL=0 python benchmarks/decode_attention_in_step.py --output decode_attention_in_step.json
  --tiles none: the engine's launch alone; --cache-layout heads | both: the caches also (or only) stored heads-major
  within a block ([2, blocks, KV heads, slots, d], handed to the kernel as a view in the engine's index order), the
  layout session 56 timed (cache_layout_in_step_h100_s56.json; docs/gpu.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepserve.kernels.decode_launch import SPLIT_MERGE, DecodeTiles, launch_num_splits  # noqa: E402
from deepserve.kernels.paged_attention import decode_attention  # noqa: E402

BLOCK = 16
SHAPES = {"qwen3-moe": (32, 4, 128), "llama-3-8b": (32, 8, 128), "llama-3.2-1b": (32, 8, 64)}   # (H, KV heads, D)
TILES = [DecodeTiles(64, 4, 2, True), DecodeTiles(64, 4, 3, True), DecodeTiles(32, 4, 3, True),
         DecodeTiles(32, 4, 2, True), DecodeTiles(128, 8, 2, True), DecodeTiles(128, 4, 3, True),
         DecodeTiles(64, 8, 3, True), DecodeTiles(16, 4, 3, True), DecodeTiles(32, 2, 3, True),
         DecodeTiles(64, 2, 2, True)]
EXTRA_KEYS = 22          # the sweep's sequences sit at context + 20-24 keys when timed


def forced_tiles(spec: str) -> DecodeTiles:
    """'64x4x3eh' (fp8_attention_kernels.parse_tiles' notation, no split or register cap) -> DecodeTiles."""
    from fp8_attention_kernels import parse_tiles
    t = parse_tiles(spec)
    return DecodeTiles(t["block_n"], t["num_warps"], t["num_stages"], t["early_v"], t["heads_first"],
                       kv_heads=t["kv_heads"])


def block_table(batch: int, keys: int, layout: str, gen: torch.Generator):
    per_seq = -(-keys // BLOCK)
    total = batch * per_seq
    ids = torch.arange(total) if layout == "runs" else torch.randperm(total, generator=gen)
    return total + 1, ids.view(batch, per_seq).to(torch.int32).cuda()


def kernel_us(fn, calls: int = 6) -> dict:
    """Mean duration (us) of each Triton kernel name `fn` launches, over a graph of `calls` calls of fn replayed
    three times under the profiler."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    g.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
    sums: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "decode" in e.name:
            slot = sums.setdefault(e.name, [0.0, 0])
            slot[0] += e.time_range.end - e.time_range.start
            slot[1] += 1
    return {name: round(v[0] / v[1], 2) for name, v in sums.items()}


def cache_tensor(num_blocks: int, hkv: int, d: int, dtype: torch.dtype, heads_major: bool) -> torch.Tensor:
    """A zeroed [2, blocks, BLOCK, KV heads, d] cache; `heads_major`: stored [2, blocks, KV heads, BLOCK, d] (each
    head's slots of a block one contiguous run) and returned as a view in the engine's index order."""
    if heads_major:
        return torch.zeros(2, num_blocks, hkv, BLOCK, d, dtype=dtype, device="cuda").transpose(2, 3)
    return torch.zeros(2, num_blocks, BLOCK, hkv, d, dtype=dtype, device="cuda")


def layer_caches(num_blocks: int, hkv: int, d: int, layers: int, pool_gb: float,
                 dtype: torch.dtype = torch.bfloat16, heads_major: bool = False) -> list:
    """One cache, or (--layers) one per layer as the engine allocates them: each sized to its share of a pool of
    pool_gb GB, the blocks in use at its start (random values there, zeros beyond); `dtype` the cache's;
    `heads_major` (--cache-layout heads): `cache_tensor`'s."""
    if layers <= 1:
        c = cache_tensor(num_blocks, hkv, d, dtype, heads_major)
        c.copy_(torch.randn(2, num_blocks, BLOCK, hkv, d, dtype=torch.bfloat16, device="cuda").to(dtype))
        return [c]
    per_block = 2 * BLOCK * hkv * d * dtype.itemsize
    pool_blocks = max(num_blocks, int(pool_gb * 1e9 / layers / per_block))
    caches = []
    for _ in range(layers):
        c = cache_tensor(pool_blocks, hkv, d, dtype, heads_major)
        c[:, :num_blocks] = torch.randn(2, num_blocks, BLOCK, hkv, d, dtype=torch.bfloat16, device="cuda").to(dtype)
        caches.append(c)
    return caches


def run_case(shape, batch: int, context: int, layout: str, candidates, weights, x, layers: int = 1,
             pool_gb: float = 0.0, cache_dtype: torch.dtype = torch.bfloat16, heads_major: bool = False) -> dict:
    h, hkv, d = shape
    keys = context + EXTRA_KEYS
    gen = torch.Generator().manual_seed(batch + context)
    num_blocks, table = block_table(batch, keys, layout, gen)
    caches = layer_caches(num_blocks, hkv, d, layers, pool_gb, cache_dtype, heads_major)
    q = torch.randn(batch, h, d, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    rows = torch.arange(batch, device="cuda")
    lens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
    kv_bytes = batch * keys * 2 * hkv * d * cache_dtype.itemsize
    res = {"batch": batch, "context": keys, "layout": layout, "cache_dtype": str(cache_dtype),
           "cache_layout": "heads" if heads_major else "slots",
           "kv_MB": round(kv_bytes / 1e6, 1), "layers": len(caches),
           "engine_splits": launch_num_splits(batch, h, caches[0], keys, SPLIT_MERGE == "last"), "us": {}}
    for splits, tiles in candidates:
        def step():
            for i, cache in enumerate(caches):      # a layer each: its GEMM, then attention over its cache
                F.linear(x, weights[i % len(weights)])
                decode_attention(q, cache, table, lens, 0.1, out=out, q_rows=rows, seq_ids=rows, max_seq_len=keys,
                                 num_splits=splits, tiles=tiles)
        try:
            times = kernel_us(step, calls=6 if len(caches) == 1 else 1)
        except Exception as exc:    # a setting that does not compile or fit is reported, not fatal
            res["us"][f"{splits} {tiles}"] = str(exc)[:200]
            continue
        total = sum(times.values())
        res["us"][f"{splits} {tiles}"] = [round(total, 2)] + [times[k] for k in sorted(times)]
    timed = {k: v[0] for k, v in res["us"].items() if isinstance(v, list)}
    best = min(timed, key=timed.get)
    res["best"] = (best, timed[best], round(kv_bytes / timed[best] / 1e6, 3))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="llama-3-8b:32,64,128:1024;qwen3-moe:64,128,256:1024;"
                                       "llama-3-8b:32,64:4096;llama-3.2-1b:64,128:1024")
    ap.add_argument("--splits", default="1,2,3")
    ap.add_argument("--layout", default="runs", choices=["runs", "shuffled", "both"])
    ap.add_argument("--layers", type=int, default=1, help="a cache (and a GEMM) per layer, cycled within a call")
    ap.add_argument("--pool-gb", type=float, default=0.0, help="with --layers: the caches' total size, as the engine's")
    ap.add_argument("--weights", type=int, default=1, help="distinct 235 MB GEMM weights, cycled over the layers")
    ap.add_argument("--few-tiles", action="store_true", help="only the first two tile candidates")
    ap.add_argument("--tiles", default="", help="the tile candidates in fp8_attention_kernels.py's notation, e.g. "
                    "64x4x2,64x4x3h (default: TILES; none: the engine's launch alone)")
    ap.add_argument("--cache-dtype", default="bfloat16", choices=["bfloat16", "float8_e4m3fn", "float8_e5m2"])
    ap.add_argument("--cache-layout", default="slots", choices=["slots", "heads", "both"],
                    help="a block's [slots, KV heads, d] (the engine's) or [KV heads, slots, d] (heads-major)")
    ap.add_argument("--output", default="decode_attention_in_step.json")
    args = ap.parse_args()
    out = {"command": "DEEPSERVE_PDL=" + os.environ.get("DEEPSERVE_PDL", "1") + " python " + " ".join(sys.argv),
           "gpu": torch.cuda.get_device_name(), "results": []}
    weights = [torch.randn(28672, 4096, dtype=torch.bfloat16, device="cuda") * 0.01 for _ in range(args.weights)]
    layouts = ["runs", "shuffled"] if args.layout == "both" else [args.layout]
    splits = [int(s) for s in args.splits.split(",")]
    if args.tiles == "none":        # the engine's own launch only
        tiles = []
    elif args.tiles:
        tiles = [forced_tiles(t) for t in args.tiles.split(",")]
    else:
        tiles = TILES[:2] if args.few_tiles else TILES
    for case in args.cases.split(";"):
        name, batches, contexts = case.split(":")
        for context in map(int, contexts.split(",")):
            for batch in map(int, batches.split(",")):
                x = torch.randn(batch, 4096, dtype=torch.bfloat16, device="cuda")
                candidates = [(None, None)] + [(s, t) for s in splits for t in tiles]
                cache_layouts = ["slots", "heads"] if args.cache_layout == "both" else [args.cache_layout]
                for layout, cache_layout in [(lo, cl) for lo in layouts for cl in cache_layouts]:
                    r = run_case(SHAPES[name], batch, context, layout, candidates, weights, x, args.layers,
                                 args.pool_gb, getattr(torch, args.cache_dtype), cache_layout == "heads")
                    r["shape"] = name
                    out["results"].append(r)
                    print(name, batch, context, layout, cache_layout, "engine", r["us"]["None None"], "best",
                          r["best"], flush=True)
                    with open(args.output, "w") as f:
                        json.dump(out, f, indent=1)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
