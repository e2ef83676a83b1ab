"""DeepSeek-V4.1's sink attention kernel (kernels/sparse_attention.py) against an older copy of that module
(`--before`), in one run: 64 heads x 512 (one shared latent KV head), each row gathering a 128-slot sliding window
from one cache and 512 selected compressed entries from another (V4.1-Flash's decode), bf16, random slots.
Each setting runs inside a CUDA graph of 20 calls that cycle over enough cache copies to exceed the L2 (a step's
attention reads its layer's cache cold). Reported: microseconds per call, before and now at each one's own launch
setting, and the gathered key bytes per call / time.

Run (GPU machine):
  git show <rev>:deepserve/kernels/sparse_attention.py > /tmp/sparse_attention_before.py
  python benchmarks/sink_attention_ab.py --before /tmp/sparse_attention_before.py --output sink_attention_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from deepserve.kernels.sparse_attention import sink_attention_gathered  # noqa: E402
from mla_decode_ab import load_before  # noqa: E402
from tune_gemv import graph_time  # noqa: E402

HEADS, DIM, WINDOW, SELECTED = 64, 512, 128, 512
L2_BYTES = 60e6


def case(rows: int, before) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    window_slots, entries = rows * WINDOW, max(4096, rows * SELECTED)
    key_bytes = rows * (WINDOW + SELECTED) * DIM * 2
    copies = max(1, int(-(-L2_BYTES // key_bytes)))
    sources = []
    for _ in range(copies):
        swa = torch.randn(window_slots, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        kv = torch.randn(entries, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
        main_slots = torch.arange(window_slots, device="cuda", dtype=torch.int32).view(rows, WINDOW)
        block_slots = torch.randint(0, entries, (rows, SELECTED), device="cuda", dtype=torch.int32, generator=gen)
        sources.append([(swa, main_slots), (kv, block_slots)])
    q = torch.randn(rows, HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=gen)
    sink = torch.randn(HEADS, device="cuda", dtype=torch.float32, generator=gen)
    scale = DIM ** -0.5
    res = {"rows": rows, "key_MB": round(key_bytes / 1e6, 1), "cache_copies": copies}
    ref = sink_attention_gathered(q, sources[0], sink, scale)
    for name, fn in (("before", before.sink_attention_gathered if before else None), ("now", sink_attention_gathered)):
        if fn is None:
            continue
        res[f"{name}_max_diff"] = round((fn(q, sources[0], sink, scale) - ref).abs().max().item(), 5)
        us = graph_time(lambda c: fn(q, sources[c], sink, scale), copies) * 1e3
        res[f"{name}_us"] = round(us, 2)
        res[f"{name}_TBps"] = round(key_bytes / us / 1e6, 3)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,4,16,64,128,256")
    ap.add_argument("--before", default=None, help="path of an older sparse_attention.py to time in the same run")
    ap.add_argument("--output", default="sink_attention_ab.json")
    args = ap.parse_args()
    before = load_before(args.before, "sparse_attention_before") if args.before else None
    out = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
           "shape": {"heads": HEADS, "head_dim": DIM, "window": WINDOW, "selected": SELECTED}, "results": []}
    for rows in [int(r) for r in args.rows.split(",")]:
        r = case(rows, before)
        out["results"].append(r)
        print(json.dumps(r), flush=True)
        torch.cuda.empty_cache()
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
