"""MLA decode kernel variants on the GPU (DeepSeek-V2-Lite's 16 heads, 512 + 64 latent, block size 16), against
the kernel as it was before (`--before`, a copy of an older deepserve/kernels/mla_decode.py) in the same run.

For each batch and context: every sequence at `context` tokens, shuffled blocks (in order with
--contiguous-blocks); each setting runs inside a CUDA graph of 20 calls that cycle over enough cache copies to
exceed the 50 MB L2 (a decode step's attention reads its layer's cache cold). Reported: microseconds per call and KV
TB/s (latent bytes the call must read / time) for the engine's pick (before and now), then every variant (tile x
split count), and the best.

Run (GPU machine):
  git show <rev>:deepserve/kernels/mla_decode.py > /tmp/mla_decode_before.py
  python benchmarks/mla_decode_ab.py --before /tmp/mla_decode_before.py --output mla_decode_ab.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from deepserve.kernels.mla_decode import mla_decode, mla_num_splits  # noqa: E402
from tune_decode_attention import BLOCK, paged_inputs  # noqa: E402
from tune_gemv import graph_time  # noqa: E402

HEADS, RANK, ROPE = 16, 512, 64
L2_BYTES = 60e6
# (block_n, warps, stages); mla_decode_layouts_ab_h200.json also has the tokens-as-M layout, since dropped.
VARIANTS = [(32, 4, 3), (32, 4, 2), (64, 4, 2), (64, 8, 2), (32, 8, 2), (64, 8, 3), (16, 4, 3)]
SPLITS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]


def load_before(path: str, name: str = "mla_decode_before"):
    """An older copy of a kernel module, imported from its file under `name` (also sink_attention_ab.py's and
    ab_kernel_modes.py's)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod             # its dataclasses (if any) look their module up there
    spec.loader.exec_module(mod)
    return mod


def case(batch: int, context: int, before, splits_grid: list, variants: list, contiguous: bool = False) -> dict:
    gen = torch.Generator().manual_seed(batch + context)
    num_blocks, table, seq_lens = paged_inputs(batch, context, gen)
    if contiguous:      # each sequence's blocks one after another, as a fresh engine allocates them
        table = torch.arange(table.numel(), dtype=table.dtype, device=table.device).view_as(table)
    kv_bytes = batch * context * (RANK + ROPE) * 2
    copies = max(1, int(-(-L2_BYTES // kv_bytes)))
    caches = [torch.randn(num_blocks, BLOCK, RANK + ROPE, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]
    q_lat = torch.randn(batch, HEADS, RANK, dtype=torch.bfloat16, device="cuda")
    q_pe = torch.randn(batch, HEADS, ROPE, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q_lat)

    def time_us(fn, **kw) -> float:
        return graph_time(lambda c: fn(q_lat, q_pe, caches[c], table, seq_lens, 0.1, out=out, max_seq_len=context,
                                       **kw), copies) * 1e3

    res = {"batch": batch, "context": context, "kv_MB": round(kv_bytes / 1e6, 1), "cache_copies": copies,
           "blocks": "contiguous" if contiguous else "shuffled",
           "engine_splits": mla_num_splits(batch, HEADS, context, q_lat.device)}
    if before is not None:
        res["before_us"] = round(time_us(before.mla_decode), 2)
    res["engine_us"] = round(time_us(mla_decode), 2)
    timings = {}
    for bn, warps, stages in variants:
        for splits in splits_grid:
            if splits > 1 and -(-context // splits) < bn:
                continue
            key = f"bn={bn} w={warps} st={stages} splits={splits}"
            try:
                timings[key] = round(time_us(mla_decode, num_splits=splits, block_n=bn, num_warps=warps,
                                              num_stages=stages), 2)
            except Exception as exc:     # a setting that does not fit (shared memory) is reported, not fatal
                timings[key] = f"error: {str(exc)[:120]}"
    res["variants_us"] = timings
    for name in ("before_us", "engine_us"):
        if name in res:
            res[name.replace("_us", "_TBps")] = round(kv_bytes / res[name] / 1e6, 3)
    timed = {k: v for k, v in timings.items() if isinstance(v, float)}
    if timed:
        best = min(timed, key=timed.get)
        res["best"] = (timed[best], best)
        res["best_TBps"] = round(kv_bytes / timed[best] / 1e6, 3)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="8,16,32,64,128,256")
    ap.add_argument("--contexts", default="1024")
    ap.add_argument("--splits", default=",".join(map(str, SPLITS)))
    ap.add_argument("--no-variants", action="store_true", help="only the engine's pick, before and now")
    ap.add_argument("--before", default=None, help="path of an older mla_decode.py to time in the same run")
    ap.add_argument("--output", default="mla_decode_ab.json")
    ap.add_argument("--contiguous-blocks", action="store_true",
                    help="each sequence's cache blocks in order (the engine's layout after a fresh prefill), not "
                         "shuffled: session 23 and 24 saw one-split 64-token tiles win alone and lose in the step")
    args = ap.parse_args()
    before = load_before(args.before) if args.before else None
    out = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
           "shape": {"heads": HEADS, "kv_lora_rank": RANK, "rope": ROPE, "block_size": BLOCK}, "results": []}
    splits_grid = [int(s) for s in args.splits.split(",")]
    for context in [int(c) for c in args.contexts.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            r = case(batch, context, before, splits_grid, [] if args.no_variants else VARIANTS,
                     contiguous=args.contiguous_blocks)
            out["results"].append(r)
            print(batch, context, {k: r.get(k) for k in ("engine_splits", "before_us", "engine_us", "best",
                                                         "before_TBps", "best_TBps")}, flush=True)
            torch.cuda.empty_cache()
            with open(args.output, "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
