"""Which split counts a real engine's MLA decode launches take: every `mla_decode` call of the TritonMLA backend
(CUDA-graph captures and steps) recorded as (rows, heads, max_seq_len, forced splits, the heuristic's splits, under
capture), for DeepSeek-V2-Lite with random weights at batch `--batch`, `--context`-token prompts, E4M3 cache.

Why: session 34's V2-Lite batch-256 step profile on an H100 (h100_v2lite_b256_profile_s34.json) lists an MLA split
reduce per layer, where `mla_num_splits` gives one split (no reduce) for 256 rows of 16 heads on 132 SMs; this shows
what the launches actually get.

Run (GPU machine):  python benchmarks/mla_split_choices.py [--batch 256] [--context 1024] [--output F.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import h200_moe  # noqa: E402
import deepserve.kernels.mla_decode as mla_decode_module  # noqa: E402
import deepserve.layers.mla_triton as mla_triton  # noqa: E402
from deepserve import LLM  # noqa: E402
from profile_gpu_step import start_decoding  # noqa: E402


def recording(calls: collections.Counter):
    """A stand-in for mla_decode that counts each launch's shape and split choice, then runs the real one."""
    real = mla_decode_module.mla_decode

    def mla_decode(q_lat, q_pe, kv_cache, block_tables, seq_lens, scale, out=None, max_seq_len=None,
                   num_splits=None, **kw):
        picked = mla_decode_module.mla_num_splits(q_lat.shape[0], q_lat.shape[1], max_seq_len, q_lat.device)
        calls[(q_lat.shape[0], q_lat.shape[1], max_seq_len, num_splits, picked,
               torch.cuda.is_current_stream_capturing())] += 1
        return real(q_lat, q_pe, kv_cache, block_tables, seq_lens, scale, out=out, max_seq_len=max_seq_len,
                    num_splits=num_splits, **kw)
    return mla_decode


def table(calls: collections.Counter) -> list[dict]:
    keys = ("rows", "heads", "max_seq_len", "forced_splits", "heuristic_splits", "capturing")
    return [dict(zip(keys, k), launches=n) for k, n in sorted(calls.items(), key=lambda kv: -kv[1])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--output", default="mla_split_choices.json")
    args = ap.parse_args()
    calls: collections.Counter = collections.Counter()
    mla_triton.mla_decode = recording(calls)
    config = h200_moe.write_config(h200_moe.SHAPES["deepseek-v2-lite"])
    llm = LLM(config, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", device="cuda",
              max_model_len=args.context + 64, max_num_seqs=args.batch, max_num_batched_tokens=8192,
              kv_cache_dtype="fp8", gpu_memory_utilization=0.85)
    result = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
              "sms": mla_decode_module.num_sms(torch.device("cuda")),
              "programs_per_sm": mla_decode_module.PROGRAMS_PER_SM, "start_up": table(calls)}
    calls.clear()
    start_decoding(llm.engine, args.batch, args.context, 12, "splits", 1)
    result["decode"] = table(calls)
    print(json.dumps(result, indent=1))
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
