"""GPU decode attention kernels over a bf16 and an fp8 KV cache, for each setting of the switches that shape the fp8
kernels (DEEPSERVE_FP8_WIDEN: where the codes widen; DEEPSERVE_FP8_PRODUCTS: the products' dtype; both in
kernels/kv_rounding.py), in one run: each setting in a process of its own (they are read at import), the same cases
and cache contents in each; with --tiles, every cache also under forced launch settings.

Cases are real shapes at decode batch sizes: Llama-3-8B GQA (32 query / 8 KV heads of 128), Llama-3.2-1B (32 / 8
of 64), Qwen3-MoE (32 / 4 of 128), DeepSeek-V2-Lite MLA (16 heads, 512-rank latents + 64 rope dims). Every sequence
has `context` keys in shuffled 16-slot blocks (--block-size); the caches (0.3-9 GB) are far larger than L2, so
each call reads its keys from HBM.
Reported per case and cache dtype: microseconds a call (CUDA events over the replays of a CUDA graph of 20 calls,
median of 5 runs; before session 30, back-to-back launches, which timed the host at small batches) and the KV bytes it
reads over that time.

Run (GPU machine):  python benchmarks/fp8_attention_kernels.py --output fp8_attention_kernels_h200.json
                    [--settings "DEEPSERVE_FP8_WIDEN=values;DEEPSERVE_FP8_PRODUCTS=f16"] [--tiles 64x4x2,128x4x2]
                    [--cases mla]   (the cases whose name or kind holds one of these words; default: all)
  (--settings: ";" between settings, "+" between the variables of one; a bare value is a DEEPSERVE_FP8_WIDEN one;
   --tiles: keys per tile x warps x stages, an "e" suffix loads a tile's values with its keys (GQA only), "t"
   reads the values from a copy of the cache with each block's values stored transposed (GQA only), "p" reads
   two KV heads a program (GQA only, DecodeTiles.kv_heads), "sN"
   forces N context splits, an "rN" suffix caps the registers a thread at N (DEEPSERVE_MLA_DECODE_TILES' form, e.g.
   32x4x2r168; with a split count 32x4x3s2r128))
Plot (anywhere):    python benchmarks/fp8_attention_kernels.py --plot fp8_attention_kernels_h200.json
                    [--steps kv_fp8_sweep_s29_h200.json]   (decode steps, bf16 against fp8 caches, beside it)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = {   # name: (kind, batch, context, heads, kv_heads, head_dim)
    "llama-3-8b b8 ctx4096": ("gqa", 8, 4096, 32, 8, 128),
    "llama-3-8b b64 ctx4096": ("gqa", 64, 4096, 32, 8, 128),
    "llama-3-8b b256 ctx1024": ("gqa", 256, 1024, 32, 8, 128),
    "llama-3.2-1b b8 ctx1024": ("gqa", 8, 1024, 32, 8, 64),       # split
    "llama-3.2-1b b64 ctx4096": ("gqa", 64, 4096, 32, 8, 64),     # no split, DEEP_PIPELINE_TILES
    "llama-3.2-1b b64 ctx1024": ("gqa", 64, 1024, 32, 8, 64),
    "llama-3.2-1b b256 ctx1024": ("gqa", 256, 1024, 32, 8, 64),
    "qwen3-moe b128 ctx1024": ("gqa", 128, 1024, 32, 4, 128),     # Qwen3-30B-A3B: 32 query / 4 KV heads of 128
    "qwen3-moe b256 ctx1024": ("gqa", 256, 1024, 32, 4, 128),
    "deepseek-v2-lite b8 ctx1024": ("mla", 8, 1024, 16, 1, 576),
    "deepseek-v2-lite b64 ctx1024": ("mla", 64, 1024, 16, 1, 576),
    "deepseek-v2-lite b128 ctx1024": ("mla", 128, 1024, 16, 1, 576),
    "deepseek-v2-lite b256 ctx1024": ("mla", 256, 1024, 16, 1, 576),
    "deepseek-v2-lite b64 ctx4096": ("mla", 64, 4096, 16, 1, 576),
}
CACHE_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")
BLOCK = 16


def time_call(fn, reps: int = 20) -> tuple[float, str]:
    """(microseconds a call, how it was timed). Device time: `reps` calls captured in one CUDA graph, as a decode
    step runs them, and the graph's replays timed with CUDA events (median of 5). Launched one by one from Python,
    small calls timed the host instead: on the session-30 H100 the MLA kernel at batch 8 "took" 100-240 us against
    about 10 us in a step's graph. A call that cannot be captured falls back to back-to-back launches ("eager")."""
    import torch
    fn()
    torch.cuda.synchronize()
    try:
        side = torch.cuda.Stream()          # warm-up on a side stream before capture (torch.cuda.graphs' advice)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        run, mode = graph.replay, "graph"
    except Exception:
        torch.cuda.synchronize()

        def run():
            for _ in range(reps):
                fn()
        mode = "eager"
    run()
    runs = []
    for _ in range(5):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        stop.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(stop) / reps * 1e3)
    return sorted(runs)[2], mode


def parse_tiles(spec: str) -> dict:
    """'KEYSxWARPSxSTAGES' + optional suffixes in this order: 'e' (GQA: values loaded with keys), 'h' (GQA: a row's
    KV heads launched side by side), 't' (GQA: values stored transposed in each block), 'p' (GQA: two KV heads a
    program, DecodeTiles.kv_heads), 'sN' (N context splits), 'rN' (a register cap) -> the launch's keywords."""
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)(e?)(h?)(t?)(p?)(?:s(\d+))?(?:r(\d+))?", spec.lower())
    if not match:
        raise ValueError(f"tiles {spec!r}: expected KEYSxWARPSxSTAGES[e][h][t][p][sSPLITS][rREGISTERS], e.g. "
                         "32x4x3s2r128")
    n, w, st, early, heads_first, values_t, pairs, splits, cap = match.groups()
    return {"block_n": int(n), "num_warps": int(w), "num_stages": int(st), "early_v": bool(early),
            "heads_first": bool(heads_first), "values_t": bool(values_t), "kv_heads": 2 if pairs else 1,
            "maxnreg": int(cap) if cap else None, "num_splits": int(splits) if splits else None}


def run_case(name: str, cache_dtype: str, tiles: str | None = None) -> dict:
    import torch
    from deepserve.kernels.mla_decode import mla_decode
    from deepserve.kernels.decode_launch import DecodeTiles
    from deepserve.kernels.paged_attention import decode_attention
    kind, batch, context, heads, kv_heads, dim = CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq
    tables = torch.randperm(num_blocks, device="cuda", generator=gen).view(batch, blocks_per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    dtype = getattr(torch, cache_dtype)
    shape = (2, num_blocks, BLOCK, kv_heads, dim) if kind == "gqa" else (num_blocks, BLOCK, dim)
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen).to(dtype)
    launch = parse_tiles(tiles) if tiles else {}
    if kind == "gqa":
        forced = DecodeTiles(block_n=launch["block_n"], num_warps=launch["num_warps"],
                             num_stages=launch["num_stages"], early_v=launch["early_v"],
                             heads_first=launch["heads_first"], values_t=launch["values_t"],
                             kv_heads=launch["kv_heads"], maxnreg=launch["maxnreg"]) if tiles else None
        used = cache
        if forced is not None and forced.values_t:     # the same values, each block's stored [KV heads, dim, slots]
            used = cache.clone()
            used[1] = cache[1].permute(0, 2, 3, 1).contiguous().view(cache[1].shape)

        def call():
            return decode_attention(q, used, tables, seq_lens, dim ** -0.5, max_seq_len=context, tiles=forced,
                                    num_splits=launch.get("num_splits"))
        if forced is not None and forced.values_t:     # the same output as the launcher's own layout, near enough
            same = decode_attention(q, cache, tables, seq_lens, dim ** -0.5, max_seq_len=context)
            diff = (call().float() - same.float()).abs().max().item()
            assert diff < 2e-2, f"values-transposed output differs by {diff}"
    else:
        q_lat, q_pe = q[..., :512], q[..., 512:]
        if launch.pop("early_v", False) or launch.pop("heads_first", False) or launch.pop("values_t", False) \
                or launch.pop("kv_heads", 1) > 1:
            raise ValueError(f"tiles {tiles!r}: 'e', 'h', 't' (values transposed) and 'p' (KV head pairs) are the "
                             "GQA kernel's")

        def call():
            mla_decode(q_lat, q_pe, cache, tables, seq_lens, dim ** -0.5, max_seq_len=context, **launch)
    us, timing = time_call(call)
    kv_bytes = batch * context * (2 * kv_heads * dim if kind == "gqa" else dim) * cache.element_size()
    return {"us": round(us, 2), "kv_bytes": kv_bytes, "kv_TBps": round(kv_bytes / us / 1e6, 3), "timing": timing}


def chosen_cases(words: str) -> list[str]:
    """The case names that hold one of the comma-separated `words` or whose kind is one ("" : all of them)."""
    wanted = [w for w in words.split(",") if w]
    return [name for name, case in CASES.items() if not wanted or any(w in name or w == case[0] for w in wanted)]


def measure_here(tiles: list[str], cases: list[str], dtypes: list[str] = CACHE_DTYPES) -> dict:
    """{case: {cache dtype: timing}} under the launcher's own settings, plus {"<cache dtype> <tiles>": timing}."""
    out = {}
    for name in cases:
        out[name] = {d: run_case(name, d) for d in dtypes}
        for t in tiles:
            for d in dtypes:
                try:
                    out[name][f"{d} {t}"] = run_case(name, d, t)
                except Exception as e:     # a setting the kernel cannot launch (shared memory): say so, go on
                    out[name][f"{d} {t}"] = {"error": repr(e)[:300]}
        print(name, json.dumps(out[name]), flush=True)
    return out


def split_settings(text: str) -> list[str]:
    """"late;values" or "late,values" (bare DEEPSERVE_FP8_WIDEN values) or "A=x+B=y;A=z" -> the settings."""
    sep = ";" if ";" in text or "=" in text else ","
    return [s for s in text.split(sep) if s]


def setting_env(setting: str) -> dict:
    """"late" -> {DEEPSERVE_FP8_WIDEN: late}; "A=x+B=y" -> {A: x, B: y}."""
    pairs = [part.partition("=") for part in setting.split("+")]
    return {name: value for name, _, value in pairs} if "=" in setting else {"DEEPSERVE_FP8_WIDEN": setting}


def plot(path: str, steps_path: str | None) -> None:
    """Microseconds a call per case, one bar per (setting, cache dtype); with `steps_path` (h200_decode_sweep.py
    runs merged by kv dtype: {"dense_auto": sweep, "dense_fp8": sweep, ...}) a second panel of step times."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(path) as f:
        data = json.load(f)
    panels = 2 if steps_path else 1
    fig, axes = plt.subplots(1, panels, figsize=(8 * panels, 6.4), squeeze=False)
    ax = axes[0][0]
    cases = list(data["cases"])
    # One bar per (setting, cache dtype [+ forced tiles]) that every case timed.
    bars = []
    for s, by_case in data["by_setting"].items():
        if "error" in by_case:
            continue
        labels = [k for k, v in by_case[cases[0]].items() if isinstance(v, dict) and v.get("us")]
        bars += [(s, k) for k in labels if all(by_case[c].get(k, {}).get("us") for c in cases)]
    width = 0.8 / len(bars)
    many = len(data["by_setting"]) > 1
    for j, (setting, label) in enumerate(bars):
        us = [data["by_setting"][setting][c][label]["us"] for c in cases]
        ax.bar([i + j * width for i in range(len(cases))], us, width, label=label + (f", {setting}" if many else ""))
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))], cases, rotation=25, ha="right", fontsize=7)
    ax.set_ylabel("us per call (one layer)")
    ax.set_title(f"decode attention kernels, {data['gpu']}", fontsize=9)
    ax.legend(fontsize=6, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    if steps_path:
        with open(steps_path) as f:
            steps = json.load(f)
        ax = axes[0][1]
        labels, auto, fp8 = [], [], []
        for key in sorted(k for k in steps if k.endswith("_auto")):
            for name, by_ctx in steps[key]["results"].items():
                for ctx, entry in by_ctx.items():
                    other = steps[key[:-5] + "_fp8"]["results"][name][ctx]
                    fp8_rows = {r["batch"]: r for r in other.get("batches", []) if "step_ms" in r}
                    for r in entry.get("batches", []):
                        if "step_ms" in r and r["batch"] in fp8_rows:
                            labels.append(f"{name} b{r['batch']} {ctx}")
                            auto.append(r["step_ms"])
                            fp8.append(fp8_rows[r["batch"]]["step_ms"])
        x = range(len(labels))
        ax.bar([i - 0.2 for i in x], auto, 0.4, label="bf16 cache")
        ax.bar([i + 0.2 for i in x], fp8, 0.4, label="fp8 (E4M3) cache")
        ax.set_xticks(list(x), labels, rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("decode step, ms")
        ax.set_title("decode steps (h200_decode_sweep.py --kv-cache-dtype auto | fp8)", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.splitext(path)[0] + ".png", dpi=110)


def main() -> None:
    global BLOCK
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--settings", default="late;values;all", help="one process each (see the docstring)")
    parser.add_argument("--tiles", default="", help="forced launch settings, every cache (see the docstring)")
    parser.add_argument("--cases", default="", help="comma-separated words: the cases to run (see the docstring)")
    parser.add_argument("--cache-dtypes", default=",".join(CACHE_DTYPES), help="comma-separated, of " +
                        ", ".join(CACHE_DTYPES))
    parser.add_argument("--output", default="fp8_attention_kernels.json")
    parser.add_argument("--plot", metavar="JSON", help="draw JSON's PNG beside it, measure nothing")
    parser.add_argument("--steps", metavar="JSON", help="with --plot: merged decode-step sweeps to draw beside")
    parser.add_argument("--block-size", type=int, default=BLOCK, help="slots a cache block (the engine's default: 16)")
    parser.add_argument("--here", action="store_true", help="(internal) measure in this process, JSON to stdout")
    args = parser.parse_args()
    BLOCK = args.block_size
    dtypes = [d for d in args.cache_dtypes.split(",") if d]
    if not dtypes or not set(dtypes) <= set(CACHE_DTYPES):
        parser.error(f"--cache-dtypes {args.cache_dtypes!r}: comma-separated, of {', '.join(CACHE_DTYPES)}")
    if args.here:
        print("RESULT " + json.dumps(measure_here([t for t in args.tiles.split(",") if t], chosen_cases(args.cases),
                                                  dtypes)))
        return
    if args.plot:
        plot(args.plot, args.steps)
        return
    import torch
    fields = ("kind", "batch", "context", "heads", "kv_heads", "head_dim")
    result = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "block_size": BLOCK,
              "cases": {k: dict(zip(fields, CASES[k])) for k in chosen_cases(args.cases)},
              "by_setting": {}}
    for setting in split_settings(args.settings):
        env = dict(os.environ, **setting_env(setting))
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--here", "--tiles", args.tiles,
                               "--cases", args.cases, "--cache-dtypes", args.cache_dtypes,
                               "--block-size", str(args.block_size)], env=env,
                              capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            result["by_setting"][setting] = {"error": proc.stderr[-3000:]}
        else:
            result["by_setting"][setting] = json.loads(lines[-1][len("RESULT "):])
        print(setting, json.dumps(result["by_setting"][setting])[:3000], flush=True)
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)
    plot(args.output, None)


if __name__ == "__main__":
    main()
