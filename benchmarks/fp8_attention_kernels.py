"""GPU decode attention kernels over a bf16 and an fp8 KV cache, for each place the fp8 codes may widen
(DEEPSERVE_FP8_WIDEN, kernels/kv_rounding.py), in one run: each setting in a process of its own (it is read at
import), the same cases and cache contents in each.

Cases are real shapes at decode batch sizes: Llama-3-8B GQA (32 query / 8 KV heads of 128), Llama-3.2-1B (32 / 8
of 64), DeepSeek-V2-Lite MLA (16 heads, 512-rank latents + 64 rope dims). Every sequence has `context` keys in
shuffled 16-slot blocks; the caches (0.3-9 GB) are far larger than L2, so each call reads its keys from HBM.
Reported per case and cache dtype: microseconds a call (CUDA events over back-to-back calls, median of 5 runs)
and the KV bytes it reads over that time.

Run (GPU machine):  python benchmarks/fp8_attention_kernels.py --output fp8_attention_kernels_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = {   # name: (kind, batch, context, heads, kv_heads, head_dim)
    "llama-3-8b b8 ctx4096": ("gqa", 8, 4096, 32, 8, 128),
    "llama-3-8b b64 ctx4096": ("gqa", 64, 4096, 32, 8, 128),
    "llama-3-8b b256 ctx1024": ("gqa", 256, 1024, 32, 8, 128),
    "llama-3.2-1b b256 ctx1024": ("gqa", 256, 1024, 32, 8, 64),
    "deepseek-v2-lite b64 ctx1024": ("mla", 64, 1024, 16, 1, 576),
    "deepseek-v2-lite b256 ctx1024": ("mla", 256, 1024, 16, 1, 576),
}
CACHE_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
BLOCK = 16


def time_call(fn, reps: int = 20) -> float:
    import torch
    fn()
    runs = []
    for _ in range(5):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        stop.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(stop) / reps * 1e3)
    return sorted(runs)[2]


def run_case(name: str, cache_dtype: str) -> dict:
    import torch
    from deepserve.kernels.mla_decode import mla_decode
    from deepserve.kernels.paged_attention import decode_attention
    kind, batch, context, heads, kv_heads, dim = CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq
    tables = torch.randperm(num_blocks, device="cuda", generator=gen).view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    dtype = getattr(torch, cache_dtype)
    if kind == "gqa":
        shape = (2, num_blocks, BLOCK, kv_heads, dim)
        q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    else:
        shape = (num_blocks, BLOCK, dim)
        q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen).to(dtype)
    if kind == "gqa":
        def call():
            decode_attention(q, cache, tables, seq_lens, dim ** -0.5, max_seq_len=context)
    else:
        q_lat, q_pe = q[..., :512], q[..., 512:]

        def call():
            mla_decode(q_lat, q_pe, cache, tables, seq_lens, dim ** -0.5, max_seq_len=context)
    us = time_call(call)
    kv_bytes = batch * context * (2 * kv_heads * dim if kind == "gqa" else dim) * cache.element_size()
    return {"us": round(us, 2), "kv_bytes": kv_bytes, "kv_TBps": round(kv_bytes / us / 1e6, 3)}


def measure_here() -> dict:
    out = {}
    for name in CASES:
        out[name] = {d: run_case(name, d) for d in CACHE_DTYPES}
        print(os.environ.get("DEEPSERVE_FP8_WIDEN", "default"), name, json.dumps(out[name]), flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default="late,values,all", help="DEEPSERVE_FP8_WIDEN values, one process each")
    parser.add_argument("--output", default="fp8_attention_kernels.json")
    parser.add_argument("--here", action="store_true", help="(internal) measure in this process, JSON to stdout")
    args = parser.parse_args()
    if args.here:
        print("RESULT " + json.dumps(measure_here()))
        return
    import torch
    result = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "cases": {k: dict(zip(("kind", "batch", "context", "heads", "kv_heads",
                                                                   "head_dim"), v)) for k, v in CASES.items()},
              "by_setting": {}}
    for setting in args.settings.split(","):
        env = dict(os.environ, DEEPSERVE_FP8_WIDEN=setting)
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--here"], env=env, capture_output=True,
                              text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            result["by_setting"][setting] = {"error": proc.stderr[-3000:]}
        else:
            result["by_setting"][setting] = json.loads(lines[-1][len("RESULT "):])
        print(setting, json.dumps(result["by_setting"][setting])[:3000], flush=True)
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
