"""The CPU C decode-attention kernel (kernels/cpu/paged_attention.c) over one KV cache in each dtype it reads, in one
run: fp32, bf16, fp8 E4M3 and E5M2 as the engine builds them (the fp16 conversions of F16C / AVX-512 where the CPU
has them), and the fp8 builds with -DKV_FP8_PORTABLE (the integer-only widening other CPUs run). One call is one
layer's decode attention of `--batch` sequences over `--context` keys, the default model's heads (3 KV heads of 64,
group 3); the best of `--repeats` timed loops is reported, the dtypes alternating within each repeat.
`--lanes 8,16` builds each dtype at both vector widths (-DATTN_LANES: 16 floats, one AVX-512 register, or 8, one
AVX one; without it each build takes the CPU's own width) and times them all in the same run ("fp32@8", ...).
`--dtypes fp32,bf16` times those builds only; `--ab-define ATTN_MAX_VEC=16,ATTN_MAX_VEC=32` each of them also with
each define; `--window 0,4096` each of them with each sliding window (0: none; "fp32~4096").

Run:  python benchmarks/cpu_kv_attention.py [--context 4096] [--batch 1] [--lanes 8,16] [--dtypes ...] [--ab-define D]
          [--output benchmarks/cpu_kv_attention.json]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from deepserve.bench.throughput import machine_info, write_json
from deepserve.kernels import cpu

BUILDS = {                      # name -> (cache dtype, extra defines)
    "fp32": (torch.float32, ()),
    "bf16": (torch.bfloat16, ()),
    "fp8_e4m3": (torch.float8_e4m3fn, ()),
    "fp8_e5m2": (torch.float8_e5m2, ()),
    "fp8_e4m3_portable": (torch.float8_e4m3fn, ("KV_FP8_PORTABLE",)),
    "fp8_e5m2_portable": (torch.float8_e5m2, ("KV_FP8_PORTABLE",)),
}


def load(dtype: torch.dtype, extra: tuple[str, ...]):
    """The kernel library of `dtype`, built with `extra` defines too (not the cached engine build when extra)."""
    defines = cpu._VARIANTS[dtype] + extra
    return cpu._build.load(cpu._SOURCE, {"paged_decode_attention": cpu._ARGTYPES}, defines=defines)


def plot(result: dict, path: str) -> None:
    """One bar per build: microseconds per call (lower is better)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    us = result["us_per_call"]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(us)), 3.8))
    bars = ax.bar(list(us), list(us.values()), color="#9db4d6")
    for b, v in zip(bars, us.values()):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    setup = result["setup"]
    flags = " ".join(f for f in setup["cpu"]["isa_flags"] if "avx" in f or "amx" in f)
    ax.set_ylabel("us per call (one layer)")
    ax.set_title(f"CPU decode attention, batch {setup['batch']}, {setup['context']} keys, {setup['kv_heads']} KV heads"
                 f" x {setup['head_dim']}, group {setup['group']}, {setup['torch_threads']} threads\n"
                 f"{setup['cpu']['model']}: {flags}", fontsize=8)
    ax.tick_params(axis="x", labelrotation=45, labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--group", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--window", default="0",
                    help="comma-separated sliding windows (0: none): each build is timed at each (\"fp32~4096\")")
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--lanes", default="", help="comma-separated vector widths to build each dtype at (8, 16)")
    ap.add_argument("--dtypes", default="", help="comma-separated builds to time (default: all of BUILDS)")
    ap.add_argument("--ab-define", default="",
                    help="DEFINE[=VALUE],...: each build also with each -DDEFINE[=VALUE] (named BUILD+DEFINE), in the "
                         "same run")
    ap.add_argument("--output", default="benchmarks/cpu_kv_attention.json")
    args = ap.parse_args()
    builds = {name: b for name, b in BUILDS.items() if not args.dtypes or name in args.dtypes.split(",")}
    if args.ab_define:
        builds = {**builds, **{f"{name}+{define}": (dtype, extra + (define,))
                               for define in args.ab_define.split(",") for name, (dtype, extra) in builds.items()}}
    if args.lanes:
        builds = {f"{name}@{lanes}": (dtype, extra + (f"ATTN_LANES={lanes}",))
                  for lanes in args.lanes.split(",") for name, (dtype, extra) in builds.items()}
    windows = [int(w) for w in args.window.split(",")]
    if windows != [0]:
        builds = {f"{name}~{w}" if w else name: b for w in windows for name, b in builds.items()}
    window_of = {name: int(name.split("~")[1]) if "~" in name else 0 for name in builds}
    bs = 16
    blocks_per_seq = -(-args.context // bs)
    num_blocks = args.batch * blocks_per_seq + 1
    gen = torch.Generator().manual_seed(0)
    cache32 = torch.randn(2, num_blocks, bs, args.kv_heads, args.head_dim, generator=gen)
    tables = torch.randperm(num_blocks - 1, generator=gen)[:args.batch * blocks_per_seq].view(args.batch, -1) + 1
    lens = torch.full((args.batch,), args.context, dtype=torch.int64)
    q = torch.randn(args.batch, args.kv_heads * args.group, args.head_dim, generator=gen)
    out = torch.empty_like(q)
    plan = cpu.DecodePlan(torch.arange(args.batch), tables, lens)
    caches = {name: cache32.to(dtype) for name, (dtype, _) in builds.items()}
    libs = {name: load(dtype, extra) for name, (dtype, extra) in builds.items()}
    k_ptrs = {name: c.data_ptr() for name, c in caches.items()}

    def call(name: str) -> None:
        c = caches[name]
        _, _, block, hkv, d = c.shape
        libs[name].paged_decode_attention(
            q.data_ptr(), q.stride(0), q.stride(1), k_ptrs[name], k_ptrs[name] + c.stride(0) * c.element_size(),
            *plan._ptrs, out.data_ptr(), out.stride(0), out.stride(1), args.batch, q.shape[1], hkv, d, block,
            plan.max_blocks, window_of[name], 0.125, torch.get_num_threads())

    best = {name: float("inf") for name in builds}
    for name in builds:
        call(name)                                  # warm up (and page in) every cache
    for _ in range(args.repeats):
        for name in builds:
            t0 = time.perf_counter()
            for _ in range(args.calls):
                call(name)
            best[name] = min(best[name], (time.perf_counter() - t0) / args.calls)
    us = {name: round(t * 1e6, 1) for name, t in best.items()}
    first = next(iter(us))
    result = {"us_per_call": us, f"ratio_to_{first}": {n: round(v / us[first], 3) for n, v in us.items()},
              "setup": {"command": "python " + " ".join(shlex.quote(a) for a in sys.argv), **vars(args),
                        "date": time.strftime("%Y-%m-%d"), **machine_info()}}
    write_json(args.output, result)
    plot(result, str(Path(args.output).with_suffix(".png")))
    print(us)


if __name__ == "__main__":
    main()
