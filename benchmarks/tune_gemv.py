"""Batch-1 GEMV on the GPU: cuBLAS (F.linear) against a few Triton GEMV tilings, on the linear shapes of a
Llama-3.2-1B layer (an experiment: does a hand-written GEMV beat cuBLAS at M = 1 enough to be worth wiring?).

Times are CUDA-graph replays of 20 back-to-back calls (launch gaps as in the engine's decode graphs), L2-cold
weights (each call reads a different copy when the weights fit in L2). GB/s counts the weight bytes.

Run (GPU machine):  python benchmarks/tune_gemv.py --output tune_gemv.json [--kernel 2d --output tune_gemv_2d.json]
Plot (anywhere):    python benchmarks/tune_gemv.py --plot tune_gemv.json   (tune_gemv.png beside it)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"qkv": (3072, 2048), "o_proj": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
          "lm_head": (128256, 2048)}
# DeepSeek-V2-Lite's batch-1 GEMVs that stay on cuBLAS: q_proj, kv_a_proj, shared experts' gate/up and down.
SHAPES_V2_LITE = {"v2lite_q": (3072, 2048), "v2lite_kv_a": (576, 2048), "v2lite_shared_gate_up": (5632, 2048),
                  "v2lite_shared_down": (2048, 2816)}
# Llama-3-8B's batch-1 GEMVs with the widest rows of each class (gemv.py's gemv_shape_class): down and gate/up.
SHAPES_LLAMA3_8B = {"llama3_8b_down": (4096, 14336), "llama3_8b_gate_up": (28672, 4096)}


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    k_per = K // SPLIT_K
    k_start = pid_k * k_per
    for k0 in range(k_start, k_start + k_per, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + k).to(tl.float32)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :], mask=n_ok[:, None], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], 1)
    if SPLIT_K == 1:
        tl.store(y_ptr + n, acc.to(y_ptr.dtype.element_ty), mask=n_ok)
    else:
        tl.atomic_add(y_ptr + n, acc, mask=n_ok, sem="relaxed")


def gemv_2d(x, w, block_n, block_k, warps):
    """The engine's batch-1 GEMV (deepserve/kernels/gemv.py: products summed into a [BLOCK_N, BLOCK_K] float32
    accumulator, reduced once after the K loop) with a given tiling."""
    from deepserve.kernels.gemv import gemv_with
    return gemv_with(x[None], w, None, block_n, block_k, warps)[0]


def gemv(x, w, block_n, block_k, split_k, warps, stages):
    n, k = w.shape
    if split_k == 1:
        y = torch.empty(n, dtype=x.dtype, device=x.device)
    else:
        y = torch.zeros(n, dtype=torch.float32, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n), split_k)](x, w, y, n, k, w.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
                                                     SPLIT_K=split_k, num_warps=warps, num_stages=stages)
    return y if split_k == 1 else y.to(x.dtype)


def graph_time(fn_of_copy, copies: int, calls: int = 20) -> float:
    """ms per call: `calls` calls cycling over weight copies, captured in one graph, replayed."""
    for c in range(copies):
        fn_of_copy(c)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            for i in range(calls):
                fn_of_copy(i % copies)
    torch.cuda.synchronize()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev0.record()
    for _ in range(10):
        g.replay()
    ev1.record()
    torch.cuda.synchronize()
    return ev0.elapsed_time(ev1) / (10 * calls)


def plot(path: str) -> str:
    """A PNG beside a tune JSON: each shape's tilings, time over its fastest (cuBLAS and the best marked)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    results = json.load(open(path))["results"]
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 2.6 * len(results)), squeeze=False)
    for ax, (name, row) in zip(axes[:, 0], results.items()):
        timed = {c: v["us"] for c, v in row.items() if isinstance(v, dict) and "us" in v}
        best = min(timed.values())
        labels = list(timed)
        ax.bar(range(len(labels)), [timed[c] / best for c in labels],
               color=["tab:red" if c == "cublas" else "tab:green" if timed[c] == best else "tab:blue" for c in labels])
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=6)
        ax.set_ylim(0.95, min(2.0, max(timed[c] / best for c in labels) * 1.02))
        ax.set_title(f"{name} {row['bytes'] / 1e6:.1f} MB: best {best} us (red: cuBLAS)", fontsize=8)
        ax.set_ylabel("time / best", fontsize=7)
    fig.tight_layout()
    out = path.rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=110)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", default="tune_gemv.json")
    ap.add_argument("--plot", default="", help="draw the PNG of a tune JSON (no GPU) and exit")
    ap.add_argument("--kernel", default="1d", choices=["1d", "2d", "2d-wide"],
                    help="1d: the split-K kernel with a reduction per K step; 2d: the pair-mode GEMV (2-D accumulator); "
                         "2d-wide: the same with K steps of 512 to 2048 elements and 1 to 4 rows")
    ap.add_argument("--shapes", default="", help="comma-separated names of the shapes to time (default: all)")
    args = ap.parse_args()
    if args.plot:
        print("wrote", plot(args.plot))
        return
    if args.kernel == "1d":
        shapes = SHAPES
        configs = [(8, 256, 1, 4, 3), (16, 256, 1, 4, 3), (16, 512, 1, 8, 3), (32, 256, 1, 4, 4), (8, 512, 1, 4, 4),
                   (16, 256, 4, 4, 3), (32, 256, 4, 8, 3), (64, 128, 8, 4, 3)]
        run = gemv
    elif args.kernel == "2d":
        shapes = {**SHAPES, **SHAPES_V2_LITE}
        configs = [(bn, bk, w) for bn in (2, 4, 8, 16) for bk in (256, 512) for w in (1, 2, 4)]
        run = gemv_2d
    else:
        shapes = {**SHAPES, **SHAPES_V2_LITE, **SHAPES_LLAMA3_8B}
        configs = [(bn, bk, w) for bn in (1, 2, 4) for bk in (512, 1024, 2048) for w in (1, 2, 4, 8)]
        run = gemv_2d
    if args.shapes:
        shapes = {name: shapes[name] for name in args.shapes.split(",")}
    out = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(), "results": {}}
    for name, (n, k) in shapes.items():
        copies = max(1, min(8, (200 << 20) // (n * k * 2)))       # > L2 (50 MB) in total
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, ws[0]).float()
        row = {"bytes": n * k * 2}
        ms = graph_time(lambda c: F.linear(x, ws[c]), copies)
        row["cublas"] = {"us": round(ms * 1e3, 2), "GBps": round(n * k * 2 / ms / 1e6)}
        for cfg in configs:
            try:
                err = (run(x[0], ws[0], *cfg).float() - ref[0]).abs().max().item()
                ms = graph_time(lambda c: run(x[0], ws[c], *cfg), copies)
                row[str(cfg)] = {"us": round(ms * 1e3, 2), "GBps": round(n * k * 2 / ms / 1e6), "max_err": err}
            except Exception as exc:
                row[str(cfg)] = f"error: {str(exc)[:160]}"
        best = min((v["us"], c) for c, v in row.items() if isinstance(v, dict) and "us" in v)
        row["best"] = best
        print(name, "cublas", row["cublas"], "best", best, flush=True)
        out["results"][name] = row
        ws.clear()                            # the copies go before the next shape's
        with open(args.output, "w") as f:        # after each shape: a run cut short keeps what it timed
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
