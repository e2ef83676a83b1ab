"""Micro-benchmarks of the Triton kernels (deepserve/kernels) against their PyTorch twins on one GPU.

For each case: median time (triton.testing.do_bench, L2 flushed between runs) of the kernel and of the reference,
the fewest bytes the operation must move (each input read once, each output written once) and the achieved
bandwidth = bytes / time, next to the device-to-device copy bandwidth measured in the same run (the ceiling).
Prefill attention also reports TFLOP/s (causal FLOPs). Every case first checks kernel output against the reference.

Run:  python benchmarks/h200_kernels.py [--output benchmarks/h200_kernels.json] [--quick]
"""

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from deepserve.kernels.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from deepserve.kernels.norm import fused_add_rms_norm, fused_add_rms_norm_ref  # noqa: E402
from deepserve.kernels.kv_write import write_kv, write_kv_ref  # noqa: E402
from deepserve.kernels.decode_launch import SPLIT_MERGE, launch_num_splits  # noqa: E402
from deepserve.kernels.paged_attention import decode_attention, decode_attention_ref  # noqa: E402
from deepserve.kernels.paged_prefill import prefill_attention, prefill_attention_ref, prefill_tiles  # noqa: E402
from deepserve.kernels.rotary import apply_rotary, apply_rotary_ref  # noqa: E402
from deepserve.kernels.sampling import choose_tokens  # noqa: E402
from deepserve.layers.rotary import RotaryEmbedding  # noqa: E402
from deepserve.layers.sampler import Sampler, SamplingMetadata, SamplingRow  # noqa: E402
from deepserve.sampling_params import SamplingParams  # noqa: E402

DEV = "cuda"
BF16 = torch.bfloat16


def bench(fn, rep_ms=100):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=20, rep=rep_ms, return_mode="median")


def bench_graph(fn):
    """Replays of a captured CUDA graph: the GPU time without the host's launch overhead (inputs stay in L2 when
    they fit). None when the function cannot be captured."""
    import triton.testing
    try:
        return round(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"), 5)
    except Exception as e:  # pragma: no cover
        print("  (graph timing failed:", type(e).__name__, e, ")")
        return None


def copy_bandwidth():
    n = 1 << 30   # 1 GiB source
    src = torch.randn(n // 4, device=DEV)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * n / (ms * 1e-3) / 1e9


RESULTS = []


def record(name, shape, nbytes, ms_kernel, ms_ref, check, flops=None, extra=None, graph_fn=None):
    ms_graph = bench_graph(graph_fn) if graph_fn is not None else None
    row = {"kernel": name, "shape": shape, "bytes": nbytes, "kernel_ms": round(ms_kernel, 5),
           "kernel_graph_ms": ms_graph,
           "kernel_graph_GBps": round(nbytes / (ms_graph * 1e-3) / 1e9, 1) if ms_graph else None,
           "torch_ms": round(ms_ref, 5) if ms_ref is not None else None,
           "kernel_GBps": round(nbytes / (ms_kernel * 1e-3) / 1e9, 1),
           "torch_GBps": round(nbytes / (ms_ref * 1e-3) / 1e9, 1) if ms_ref else None,
           "speedup": round(ms_ref / ms_kernel, 2) if ms_ref else None, "check": check}
    if flops:
        row["kernel_TFLOPs"] = round(flops / (ms_kernel * 1e-3) / 1e12, 1)
        row["torch_TFLOPs"] = round(flops / (ms_ref * 1e-3) / 1e12, 1) if ms_ref else None
    if extra:
        row.update(extra)
    RESULTS.append(row)
    print(f"{name:34s} {shape:44s} kern {ms_kernel:8.4f} ms {row['kernel_GBps']:7.1f} GB/s | "
          f"torch {ms_ref if ms_ref is not None else float('nan'):8.4f} ms {row['torch_GBps'] or 0:7.1f} GB/s | "
          f"x{row['speedup']} {('%.1f TFLOP/s' % row['kernel_TFLOPs']) if flops else ''} [{check}]"
          f" graph {ms_graph} ms {row['kernel_graph_GBps']} GB/s", flush=True)


def rel_err(a, b):
    a, b = a.float(), b.float()
    return f"rel {((a - b).norm() / b.norm()).item():.1e}"


# --- cases --------------------------------------------------------------------------------------
def paged(seqs, bs, hkv, d, dtype):
    """Block tables for (cached, new) sequences on shuffled blocks; a cache with random contents."""
    nblocks = sum(-(-(c + n) // bs) for c, n in seqs) + 4
    perm = torch.randperm(nblocks).tolist()
    tables = [[perm.pop() for _ in range(-(-(c + n) // bs))] for c, n in seqs]
    mb = max(len(t) for t in tables)
    bt = torch.zeros(len(seqs), mb, dtype=torch.int64)
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t)
    cache = torch.randn(2, nblocks, bs, hkv, d, device=DEV).to(dtype)
    lens = torch.tensor([c + n for c, n in seqs], device=DEV)
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(torch.tensor([n for _, n in seqs]), 0)
    return bt.to(DEV), cache, lens, qsl.to(DEV)


def bench_write_kv(t, hkv=8, d=128, dtype=BF16):
    bs = 16
    nblocks = t // bs + 64
    cache = torch.randn(2, nblocks, bs, hkv, d, device=DEV).to(dtype)
    k = torch.randn(t, hkv, d, device=DEV).to(dtype)
    v = torch.randn(t, hkv, d, device=DEV).to(dtype)
    slots = torch.randperm(nblocks * bs, device=DEV)[:t]
    c1, c2 = cache.clone(), cache.clone()
    write_kv(c1, k, v, slots)
    write_kv_ref(c2, k, v, slots)
    check = "exact" if torch.equal(c1, c2) else "MISMATCH"
    nbytes = 4 * t * hkv * d * k.element_size() + t * 8
    fn = lambda: write_kv(cache, k, v, slots)  # noqa: E731
    record("write_kv", f"T={t} Hkv={hkv} D={d} bf16", nbytes, bench(fn),
           bench(lambda: write_kv_ref(cache, k, v, slots)), check, graph_fn=fn)


def bench_decode(b, seq_len, h=32, hkv=8, d=128, dtype=BF16, splits=None):
    bs = 16
    bt, cache, lens, _ = paged([(seq_len - 1, 1)] * b, bs, hkv, d, dtype)
    q = torch.randn(b, h, d, device=DEV).to(dtype)
    scale = 1 / math.sqrt(d)
    out = decode_attention(q, cache, bt, lens, scale, max_seq_len=seq_len, num_splits=splits)
    ref = decode_attention_ref(q, cache, bt, lens, scale)
    n_split = splits or launch_num_splits(b, h, cache, seq_len, SPLIT_MERGE == "last")
    nbytes = 2 * b * seq_len * hkv * d * q.element_size() + 2 * q.numel() * q.element_size()
    rows = torch.arange(b, device=DEV)
    o = torch.empty_like(q)
    fn = lambda: decode_attention(q, cache, bt, lens, scale, out=o, q_rows=rows, seq_ids=rows,  # noqa: E731
                                  max_seq_len=seq_len, num_splits=splits)
    record("decode_attention", f"B={b} L={seq_len} H={h} Hkv={hkv} D={d} splits={n_split}", nbytes,
           bench(fn), bench(lambda: decode_attention_ref(q, cache, bt, lens, scale)), rel_err(out, ref), graph_fn=fn)


def bench_prefill(seqs, h=32, hkv=8, d=128, dtype=BF16, label=""):
    bs = 16
    bt, cache, lens, qsl = paged(seqs, bs, hkv, d, dtype)
    t = sum(n for _, n in seqs)
    q = torch.randn(t, h, d, device=DEV).to(dtype)
    scale = 1 / math.sqrt(d)
    q_lens = [n for _, n in seqs]
    ts, tm = prefill_tiles(q_lens, list(range(len(seqs))), torch.device(DEV))
    out = prefill_attention(q, cache, bt, lens, qsl, scale, ts, tm)
    ref = prefill_attention_ref(q, cache, bt, lens, qsl, scale, seqs=list(range(len(seqs))))
    # causal FLOPs: query i of a sequence sees ctx + i + 1 keys; 2 matmuls of 2*D flops per (query, key, head)
    pairs = sum(sum(c + i + 1 for i in range(n)) for c, n in seqs)
    flops = 4 * pairs * d * h
    kv_bytes = sum(c + n for c, n in seqs) * hkv * d * 2 * q.element_size()
    nbytes = kv_bytes + 2 * q.numel() * q.element_size()
    extra = {}
    if d == 128:
        extra["kernel_ms_num_warps_8"] = round(bench(lambda: prefill_attention(q, cache, bt, lens, qsl, scale, ts, tm,
                                                                            num_warps=8)), 5)
    record("prefill_attention", f"{label} H={h} Hkv={hkv} D={d}", nbytes,
           bench(lambda: prefill_attention(q, cache, bt, lens, qsl, scale, ts, tm)),
           bench(lambda: prefill_attention_ref(q, cache, bt, lens, qsl, scale, seqs=list(range(len(seqs))))),
           rel_err(out, ref), flops=flops, extra=extra)


def bench_rms_norm(rows, hidden, dtype=BF16):
    x = torch.randn(rows, hidden, device=DEV).to(dtype)
    r = torch.randn(rows, hidden, device=DEV).to(dtype)
    w = torch.randn(hidden, device=DEV).to(dtype)
    o, ro = fused_add_rms_norm(x, r, w, 1e-6)
    e, er = fused_add_rms_norm_ref(x, r, w, 1e-6)
    check = f"res exact={torch.equal(ro, er)} out maxdiff={(o.float() - e.float()).abs().max().item():.1e}"
    nbytes = (4 * rows * hidden + hidden) * x.element_size()
    fn = lambda: fused_add_rms_norm(x, r, w, 1e-6)  # noqa: E731
    record("fused_add_rms_norm", f"N={rows} hidden={hidden} bf16", nbytes,
           bench(fn), bench(lambda: fused_add_rms_norm_ref(x, r, w, 1e-6)), check, graph_fn=fn)


def bench_rotary(t, h=32, hkv=8, d=128, dtype=BF16):
    rope = RotaryEmbedding(d, 32768, 500000.0).to(DEV)
    pos = torch.randint(0, 32768, (t,), device=DEV)
    q = torch.randn(t, h, d, device=DEV).to(dtype)
    k = torch.randn(t, hkv, d, device=DEV).to(dtype)
    oq, ok = apply_rotary(pos, q, k, rope.cos_cache, rope.sin_cache)
    rq, rk = apply_rotary_ref(pos, q, k, rope.cos_cache, rope.sin_cache)
    check = f"q exact {(oq == rq).float().mean().item():.4f}, k exact {(ok == rk).float().mean().item():.4f}"
    nbytes = 2 * t * (h + hkv) * d * q.element_size() + 2 * t * d * 4
    fn = lambda: apply_rotary(pos, q, k, rope.cos_cache, rope.sin_cache)  # noqa: E731
    record("rotary", f"T={t} H={h} Hkv={hkv} D={d} bf16", nbytes,
           bench(fn), bench(lambda: apply_rotary_ref(pos, q, k, rope.cos_cache, rope.sin_cache)), check,
           graph_fn=fn)


def bench_silu(rows, inter, dtype=BF16):
    x = torch.randn(rows, 2 * inter, device=DEV).to(dtype)
    o, r = silu_and_mul(x), silu_and_mul_ref(x)
    check = f"exact {(o == r).float().mean().item():.4f}"
    nbytes = 3 * rows * inter * x.element_size()
    record("silu_and_mul", f"N={rows} I={inter} bf16", nbytes, bench(lambda: silu_and_mul(x)),
           bench(lambda: silu_and_mul_ref(x)), check, graph_fn=lambda: silu_and_mul(x))


SAMPLE_CONFIGS = {"default": None, "small": {"block": 512, "rblock": 512, "hist": False, "num_warps": 8},
                  "mixed": {"block": 1024, "rblock": 256, "hist": True, "num_warps": 4},
                  "mid": {"block": 2048, "rblock": 512, "hist": True, "num_warps": 8}}


def bench_sampling(b, vocab, label, **kw):
    logits = torch.randn(b, vocab, device=DEV) * 3
    rows = [SamplingRow(SamplingParams(**kw), seed=i, position=1000 + i, prompt_token_ids=[], output_token_ids=[],
                        eos_token_ids=set()) for i in range(b)]
    meta = SamplingMetadata.build(rows, vocab, DEV)
    sampler = Sampler()
    out, ref = choose_tokens(logits, meta), sampler.choose_tokens(logits, meta)
    check = f"same tokens {(out == ref).float().mean().item():.3f}"
    nbytes = b * vocab * 4
    extra = {}
    for name, cfg in SAMPLE_CONFIGS.items():
        if cfg is not None:
            extra[f"kernel_graph_ms_{name}"] = bench_graph(lambda: choose_tokens(logits, meta, config=cfg))
    record("sampling", f"B={b} V={vocab} {label}", nbytes, bench(lambda: choose_tokens(logits, meta)),
           bench(lambda: sampler.choose_tokens(logits, meta)), check, extra=extra,
           graph_fn=lambda: choose_tokens(logits, meta))
    print("   sampling configs (graph ms):", extra, flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    import triton
    ceiling = copy_bandwidth()
    print(f"device-to-device copy: {ceiling:.0f} GB/s (read + write)", flush=True)
    start = time.time()
    cases = [
        lambda: bench_write_kv(256), lambda: bench_write_kv(8192),
        lambda: bench_decode(64, 4096), lambda: bench_decode(256, 1024), lambda: bench_decode(4, 8192),
        lambda: bench_decode(1, 8192), lambda: bench_decode(1, 8192, splits=8), lambda: bench_decode(4, 8192, splits=1),
        lambda: bench_decode(64, 4096, h=16, hkv=16, d=64),
        lambda: bench_prefill([(0, 2048)] * 4, label="4 x 2048 new"),
        lambda: bench_prefill([(4096, 1024), (0, 512), (1000, 300)], label="chunk over 4096 cached + 2 others"),
        lambda: bench_prefill([(0, 2048)] * 4, h=16, hkv=16, d=64, label="4 x 2048 new"),
        lambda: bench_rms_norm(16, 4096), lambda: bench_rms_norm(8192, 4096),
        lambda: bench_rotary(64), lambda: bench_rotary(8192),
        lambda: bench_silu(64, 14336), lambda: bench_silu(8192, 14336),
        lambda: bench_sampling(64, 151936, "temperature 0.8", temperature=0.8),
        lambda: bench_sampling(64, 151936, "top_k 50 top_p 0.9", temperature=0.8, top_k=50, top_p=0.9),
        lambda: bench_sampling(64, 151936, "top_p 0.9", temperature=0.8, top_p=0.9),
        lambda: bench_sampling(64, 151936, "min_p 0.05", temperature=0.8, min_p=0.05),
        lambda: bench_sampling(1, 151936, "top_k 50 top_p 0.9", temperature=0.8, top_k=50, top_p=0.9),
    ]
    if args.quick:
        cases = cases[::3]
    for case in cases:
        try:
            case()
        except Exception as e:  # keep going: one broken case must not hide the others' numbers
            print(f"CASE FAILED: {type(e).__name__}: {e}", flush=True)
            RESULTS.append({"error": f"{type(e).__name__}: {e}"})
        torch.cuda.empty_cache()
    doc = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                    "python": platform.python_version(), "copy_GBps": round(ceiling, 1)},
        "commit": os.environ.get("DEEPSERVE_COMMIT", "unknown"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "method": "median of triton.testing.do_bench (L2 flushed); bytes = each input read once + each output "
                  "written once; GBps = bytes / time; torch = the kernel's PyTorch twin (the engine's reference)",
        "seconds": round(time.time() - start, 1),
        "results": RESULTS,
    }
    if args.output:
        with open(args.output, "w") as f:
            json.dump(doc, f, indent=1)
        print("wrote", args.output)


if __name__ == "__main__":
    main()
