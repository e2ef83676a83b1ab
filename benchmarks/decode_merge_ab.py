"""Paged (GQA) decode attention split over the context, merged by a reduce launch or inside the decode kernel
(its last split program of each row and KV head), on the GPU, in one run.

For each shape, batch and context: a paged cache of block size 16 with shuffled blocks, every sequence at `context`
keys, the engine's split count (decode_num_splits; rows where it does not split are skipped: nothing to merge).
Each setting runs inside a CUDA graph of 20 calls that cycle over enough cache copies to exceed the L2 (a step
reads each layer's cache cold). Reported: microseconds per call both ways and the KV TB/s of each.

Run (GPU machine):  python benchmarks/decode_merge_ab.py --output decode_merge_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from deepserve.kernels.paged_attention import decode_attention, decode_num_splits  # noqa: E402
from tune_decode_attention import BLOCK, SHAPES, paged_inputs  # noqa: E402
from tune_gemv import graph_time  # noqa: E402

L2_BYTES = 60e6


def case(shape, batch: int, context: int) -> dict | None:
    _, h, hkv, d = shape
    splits = decode_num_splits(batch, hkv, context, torch.device("cuda"), d)
    if splits == 1:
        return None
    gen = torch.Generator().manual_seed(batch + context)
    num_blocks, table, seq_lens = paged_inputs(batch, context, gen)
    kv_bytes = batch * context * 2 * hkv * d * 2
    copies = max(1, int(-(-L2_BYTES // kv_bytes)))
    caches = [torch.randn(2, num_blocks, BLOCK, hkv, d, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
    q = torch.randn(batch, h, d, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    rows = torch.arange(batch, device="cuda")

    def time_us(merge: bool) -> float:
        return graph_time(lambda c: decode_attention(q, caches[c], table, seq_lens, 0.1, out=out, q_rows=rows,
                                                     seq_ids=rows, max_seq_len=context, merge_in_kernel=merge),
                          copies) * 1e3

    res = {"batch": batch, "context": context, "splits": splits, "kv_MB": round(kv_bytes / 1e6, 1),
           "reduce_launch_us": round(time_us(False), 2), "merge_in_kernel_us": round(time_us(True), 2)}
    res["speedup"] = round(res["reduce_launch_us"] / res["merge_in_kernel_us"], 3)
    res["merge_in_kernel_TBps"] = round(kv_bytes / res["merge_in_kernel_us"] / 1e6, 3)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3-moe,llama-3.2-1b,llama-3-8b")
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--output", default="decode_merge_ab.json")
    args = ap.parse_args()
    out = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "results": {}}
    for name in args.shapes.split(","):
        rows = out["results"][name] = []
        for context in [int(c) for c in args.contexts.split(",")]:
            for batch in [int(b) for b in args.batches.split(",")]:
                r = case(SHAPES[name], batch, context)
                if r is not None:
                    rows.append(r)
                    print(name, r, flush=True)
                torch.cuda.empty_cache()
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
