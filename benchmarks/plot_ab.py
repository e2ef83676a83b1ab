"""Plots beside this session's A/B and profile JSONs (the issue asks for a plot beside each benchmark file):
  qk_norm_fusion_h200.json      Qwen3-MoE step time before / after the q/k-norm fusion, skinny GEMM on and off
  skinny_pdl_ab_h200.json       step time per skinny-GEMM launch mode, per shape and batch
  moe_fused_combine_ab_h200.json  the MoE pair mode with and without the fused down+combine
  h200_moe_step_profiles.json   where a batch-8 step goes, kernel by kernel (PDL off: each kernel's own time)
  serve_vs_offline_cpu_xeon_amx.json  the server against offline LLM.generate on the CPU, three runs
  router_gate_ab_h200.json      the MoE gate GEMM + routing: split-K Triton kernel against cuBLAS, by tokens
  moe_shared_fusion_ab_h200.json  a MoE layer's experts with the shared experts fused into the grouped GEMMs or not
  moe_fused_align_ab_h200.json  V2-Lite decode steps with the MoE align inside the gate/up GEMM, without, and before
  moe_align_ab_h200.json        the MoE align with its one-program tile sized to the pairs, against before
  mla_absorb_cap_sweep_h200.json  V2-Lite steps with the absorb cap at 4 and at 16
  mla_absorb_ab_h200.json       MLA's W_UK / W_UV products: the Triton GEMV pair against cuBLAS, by batch
  mla_absorb_mma_ab_h200.json   the same with the tensor-core pair, by batch
  mla_absorb_mma_steps_h200.json  V2-Lite steps with the tensor-core W_UK / W_UV pair or cuBLAS's, two runs
  skinny_rows_ab_h200.json      steps at batch 24 / 32 with the skinny GEMM taking 16 or 32 rows
  mla_decode_layouts_ab_h200.json  MLA decode: block ids loaded in-loop and the tokens-as-M products, vs before
  mla_decode_reduce_ab_h200.json   MLA decode: a column-chunked split reduce, vs before
  mla_decode_few_rows_ab_h200.json MLA decode: one-tile 64-token splits at a few rows, vs before
  mla_reduce_chunk_ab_h200.json MLA decode + split reduce: 16 split rows per reduce load, vs 4 before
  session20_steps_ab_h200.json  decode steps with each of session 20's changes switched back (one run)
  mla_decode_chunks_ab_h200.json MLA decode: the latent in four chunks (independent MMA chains), vs before
  session23_steps_ab_h200.json  V2-Lite decode steps with the chunked MLA decode kernel, vs before
  sink_attention_chunks_ab_h200.json  DeepSeek-V4.1's sink attention with four column chunks, vs before
  h200_b256_kernel_sequences.json  where batch-256 (and 8B batch-128) replays go, kernel by kernel (PDL off)
  moe_align_single_ab_h200.json the MoE align of up to 2048 pairs in one program with atomics, against three launches
  session24_steps_ab_h200.json  V2-Lite / Qwen3-MoE steps with session 24's changes switched back, together and
                                one by one
  h200_b128_b8_kernel_sequences.json  V2-Lite batch-128 and Qwen3-MoE batch-8 replays, kernel by kernel (PDL off)
  mla_absorb_rows_ab_h200.json  MLA's W_UK / W_UV pair with row blocks on the grid against cuBLAS, by batch
  tune_moe_down_h200.json       the fused MoE with the down GEMM's tiles varied: the engine's pick against the best
  mla_decode_splits_h200.json   MLA decode at batch 64-256: the engine's split and tiles against the best of a grid
  moe_shared_blocks_ab_h200.json  a MoE layer with the shared experts in taller token blocks (dropped), as before, apart
  session25_steps_ab_h200.json  steps with each of session 25's changes against the code before it
  mla_decode_contiguous_h200.json  MLA decode with each sequence's blocks in order (and shuffled, not drawn)
  tune_skinny_split_h200.json   the skinny GEMM's tilings with split-K: cuBLAS, the unsplit pick, the best
  h200_b8_kernel_sequences_s25.json  Qwen3-MoE and Llama-3.2-1B batch-8 replays, kernel by kernel (PDL off)
  moe_align_one_hot_ab_h200.json  the MoE align of small decode batches: one-hot program against atomics
  tune_moe_decode_b8_h200.json  the aligned fused MoE's tiles at 8 / 16 tokens: the engine's pick against the best
  fused_norm_rows_ab_h200.json  steps with the norms in the skinny GEMM at 2-32 rows (dropped) against main
  ablate_rotary_ab_h200.json    steps with the rotary + KV-write launch skipped (a diagnostic) against the engine
  moe_persistent_down_h100_s37.json  the fused MoE with the grid down GEMM against a persistent one (dropped)
  gqa_values_transposed_h200_s37.json  GQA decode over E4M3 with each block's values stored transposed (dropped)
  moe_align_gather_ab_h100_s37.json  the one-program MoE align with tl.gather and block stores against before
  tune_moe_down_h100_s35.json   Qwen3-MoE's fused MoE at 128 / 256 tokens, down tiles varied: engine pick, best
  tune_skinny_64rows_h100_s35.json  the skinny GEMM at 64 rows of Llama-3.2-1B's weights: cuBLAS, engine, best
  decode_kv_prefetch_ab_h200.json  steps with the decode's KV tiles prefetched to L2 before the PDL wait (dropped)
  decode_small_batch_in_step_h200.json  paged GQA decode at batch 8-32: the engine's launch against the best of a
                                grid, and by context at batch 8
  inflight_patch_ab_h200.json   steps with the in-flight token patch as one device copy, against the index path
  step_outside_graph_h200.json  the device operations between two graph replays of a steady decode, on a timeline
  gqa_in_step_qwen3_e4m3_h100_s36.json, gqa_in_step_1b_bf16_h100_s36.json  paged GQA decode between GEMMs, a cache
                                a layer: the engine's launch and each tiling, rows first and heads first

Run:  python benchmarks/plot_ab.py [name ...]   (writes <name>.png beside each JSON, or the named ones; needs
      matplotlib)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


def _mean(v) -> float:
    return sum(v) / len(v) if isinstance(v, list) else v


def grouped_bars(ax, groups: dict[str, dict[str, float]], ylabel: str, title: str) -> None:
    """groups: x label -> {series: value}; one bar per series in each group."""
    series = list(dict.fromkeys(s for g in groups.values() for s in g))
    width = 0.8 / len(series)
    for i, name in enumerate(series):
        xs = [j + i * width for j in range(len(groups))]
        ax.bar(xs, [g.get(name, 0.0) for g in groups.values()], width, label=name)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(groups))])
    ax.set_xticklabels(list(groups), fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def qk_norm_fusion(path: Path) -> plt.Figure:
    d = json.loads(path.read_text())["qwen3-moe"]
    groups = {}
    for skinny in ("skinny_on", "skinny_off"):
        for batch in ("8", "16", "128"):
            row = {when: _mean(d[when][skinny][batch]) for when in ("before", "after") if batch in d[when][skinny]}
            if row:
                groups[f"b{batch} {skinny}"] = row
    fig, ax = plt.subplots(figsize=(8, 4))
    grouped_bars(ax, groups, "decode step, ms", "Qwen3-MoE decode step before / after the q/k-norm fusion (H200)")
    return fig


def mode_ab(path: Path, title: str) -> plt.Figure:
    d = json.loads(path.read_text())["step_ms"]
    groups = {f"{shape} b{batch}": {mode: _mean(v) for mode, v in modes.items()}
              for shape, batches in d.items() for batch, modes in batches.items()}
    fig, ax = plt.subplots(figsize=(8, 4))
    grouped_bars(ax, groups, "decode step, ms", title)
    return fig


def step_profiles(path: Path) -> plt.Figure:
    run = json.loads(path.read_text())["runs"]["pdl_off_after_qk_norm_fusion"]
    fig, axes = plt.subplots(1, len(run["results"]), figsize=(12, 4.5))
    for ax, (shape, by_ctx) in zip(axes, run["results"].items()):
        entry = next(iter(by_ctx.values()))
        top = [(f"{name[:34]} x{count:g}", us) for name, us, count in entry["profile_b8"]["top"][:12]]
        ax.barh([n for n, _ in top][::-1], [us for _, us in top][::-1])
        ax.set_xlabel("us per decode step (x launches per step)")
        ax.set_title(f"{shape}, batch 8, DEEPSERVE_PDL=0", fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    return fig


def serve_vs_offline(path: Path) -> plt.Figure:
    runs = json.loads(path.read_text())["runs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8))
    groups = {f"run {i + 1}": {f"concurrency {c}": r["summary"][c]["server_vs_offline"] for c in ("64", "16")}
              for i, r in enumerate(runs)}
    grouped_bars(left, groups, "server / offline output tok/s", "server vs offline (CPU, 2 cores; target >= 0.8)")
    left.axhline(0.8, color="grey", linestyle="--", linewidth=1)
    right.bar([f"run {i + 1}" for i in range(len(runs))], [r["summary"]["16"]["ttft_p50_ms"] for r in runs])
    right.set_ylabel("TTFT p50 at concurrency 16, ms")
    right.set_title("time to first token (16 requests at once)", fontsize=9)
    return fig


def per_tokens(path: Path, series: dict[str, str], title: str, x: str = "tokens") -> plt.Figure:
    """One panel per shape: microseconds per call against tokens (or another row key `x`), a line per series (JSON
    key -> label). Results: shape -> rows, or one list of rows."""
    results = json.loads(path.read_text())["results"]
    if isinstance(results, list):
        results = {"": results}
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.6), squeeze=False)
    for ax, (shape, rows) in zip(axes[0], results.items()):
        for key, label in series.items():
            have = [r for r in rows if key in r]        # a series may skip rows (e.g. a kernel out of its range)
            ax.plot([r[x] for r in have], [r[key] for r in have], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(x)
        ax.set_ylabel("us per call")
        ax.set_title(f"{shape}: {title}" if shape else title, fontsize=9)
        ax.legend(fontsize=7)
    return fig


def steps_by_batch(path: Path, title: str) -> plt.Figure:
    """Grouped bars: step ms per batch, a bar per series (results: series -> rows of batch, step_ms)."""
    results = json.loads(path.read_text())["results"]
    groups: dict[str, dict[str, float]] = {}
    for series, rows in results.items():
        for r in rows:
            groups.setdefault(r.get("label", f"batch {r['batch']}"), {})[series] = r["step_ms"]
    fig, ax = plt.subplots(figsize=(max(8, len(groups) * 1.3), 3.6))
    grouped_bars(ax, groups, "decode step, ms", title)
    return fig


def mla_decode_ab(path: Path, title: str) -> plt.Figure:
    """Grouped bars: KV TB/s per batch of the MLA decode kernel before, as the engine picks it now, and the best
    variant measured (mla_decode_ab.py's rows)."""
    groups: dict[str, dict[str, float]] = {}
    rows = json.loads(path.read_text())["results"]
    contexts = {r["context"] for r in rows}
    for r in rows:
        label = f"batch {r['batch']}" + (f", {r['context'] // 1024}k" if len(contexts) > 1 else "")
        g = groups.setdefault(label, {})
        for key, label in (("before_TBps", "before"), ("engine_TBps", "engine pick"), ("best_TBps", "best variant")):
            if r.get(key) is not None:
                g[label] = r[key]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    grouped_bars(ax, groups, "KV bytes / time, TB/s", title)
    return fig


def tuning_best(path: Path, title: str) -> plt.Figure:
    """Grouped bars per (shape, rows / tokens): cuBLAS where timed, the engine's pick, the best setting of the
    sweep (tune_skinny_gemm.py's results: shape -> rows -> setting -> us; tune_moe_decode.py's: shape -> rows of
    tokens and configs)."""
    groups: dict[str, dict[str, float]] = {}
    for shape, entry in json.loads(path.read_text())["results"].items():
        if isinstance(entry, list):         # tune_moe_decode.py
            cases = {str(r["tokens"]): r["configs"] for r in entry}
        else:                               # tune_skinny_gemm.py: keep the rows that timed the grid
            cases = {m: row for m, row in entry.items() if isinstance(row, dict) and len(row) > 8}
        for rows, settings in cases.items():
            timed = {k: v["us"] for k, v in settings.items() if isinstance(v, dict) and "us" in v}
            g = groups.setdefault(f"{shape} {rows}", {})
            if "cublas" in timed:
                g["cuBLAS"] = timed["cublas"]
            g["engine pick (then)"] = timed.get("engine", timed.get("engine pick"))
            g["best of the sweep"] = min(v for k, v in timed.items() if k not in ("cublas", "cublas_silu"))
    fig, ax = plt.subplots(figsize=(max(8, len(groups) * 0.9), 3.8))
    grouped_bars(ax, groups, "us per call", title)
    ax.tick_params(axis="x", labelrotation=60)
    return fig


def decode_in_step(path: Path, title: str) -> plt.Figure:
    """decode_attention_in_step.py's results: per case the engine's launch against the best (splits, tiles) of the
    grid (decode + reduce, us); and, from `contexts`, the engine's launch by context."""
    data = json.loads(path.read_text())
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 3.8))
    groups = {}
    for r in data["results"]:
        timed = {k: v[0] for k, v in r["us"].items() if isinstance(v, list)}
        groups[f"{r.get('shape', '')} b{r['batch']}"] = {"engine": timed["None None"],
                                                              "best of the grid": min(timed.values())}
    grouped_bars(left, groups, "decode + reduce, us", title)
    left.tick_params(axis="x", labelrotation=30)
    by_shape: dict[str, list] = {}
    for r in data.get("contexts", []):
        by_shape.setdefault(r.get("shape", ""), []).append((r["context"], r["us"]["None None"][0]))
    for shape, points in by_shape.items():
        points.sort()
        right.plot([c for c, _ in points], [u for _, u in points], marker="o", label=f"{shape} batch 8")
    right.set_xscale("log", base=2)
    right.set_xlabel("keys per sequence")
    right.set_ylabel("decode + reduce, us")
    right.set_title("the engine's launch by context (PDL off, after an L2-flushing GEMM)", fontsize=9)
    right.legend(fontsize=7)
    fig.tight_layout()
    return fig


def in_step_candidates(path: Path, title: str) -> plt.Figure:
    """decode_attention_in_step.py's results with --tiles: per (shape, batch, block layout) a bar per candidate
    launch (the engine's, then each forced tiling: keys x warps x stages, e = values early, h = heads first)."""
    data = json.loads(path.read_text())
    fig, ax = plt.subplots(figsize=(11, 4))
    groups = {}
    for r in data["results"]:
        bars = {}
        for key, v in r["us"].items():
            if not isinstance(v, list):
                continue
            if key == "None None":
                bars["engine"] = v[0]
                continue
            splits, t = key.split(" ", 1)     # "9 DecodeTiles(block_n=64, num_warps=4, ...)"
            f = dict(kv.split("=") for kv in t[t.index("(") + 1:-1].split(", "))
            label = f"{f['block_n']}x{f['num_warps']}x{f['num_stages']}" + ("e" if f["early_v"] == "True" else "") + \
                ("h" if f.get("heads_first") == "True" else "") + (f"s{splits}" if splits != "None" else "")
            bars[label] = v[0]
        groups[f"{r.get('shape', '')} b{r['batch']} {r['context']} {r['layout']}"] = bars
    grouped_bars(ax, groups, "decode kernel, us per layer", title)
    fig.tight_layout()
    return fig


def cache_layouts(path: Path, title: str) -> plt.Figure:
    """decode_attention_in_step.py --cache-layout both --tiles none: per (shape, batch, context) the engine's launch
    over a slots-major cache (the engine's) and a heads-major one."""
    data = json.loads(path.read_text())
    fig, ax = plt.subplots(figsize=(12, 4))
    groups: dict[str, dict] = {}
    for r in data["results"]:
        label = f"{r.get('shape', '')} b{r['batch']} {r['context']}"
        groups.setdefault(label, {})[r.get("cache_layout", "slots")] = r["us"]["None None"][0]
    grouped_bars(ax, groups, "decode (+ reduce), us per layer", title)
    ax.tick_params(axis="x", labelrotation=40)
    fig.tight_layout()
    return fig


def ncu_stalls(path: Path, title: str) -> plt.Figure:
    """An Nsight Compute summary ({"results": {setting: {launch: {"stall X": "v inst", ...}}}}): per setting's first
    launch, warps stalled for each reason per issued instruction (the reasons above 0.05)."""
    data = json.loads(path.read_text())
    fig, ax = plt.subplots(figsize=(10, 3.8))
    groups = {}
    for setting, launches in data["results"].items():
        first = launches[sorted(launches)[0]]
        stalls = {k[len("stall "):].replace("_per_issue_active.ratio", ""): float(v.split()[0])
                  for k, v in first.items() if k.startswith("stall ")}
        groups[setting[:48]] = {k: v for k, v in sorted(stalls.items(), key=lambda kv: -kv[1]) if v > 0.05}
    grouped_bars(ax, groups, "warps stalled per issued instruction", title)
    fig.tight_layout()
    return fig


def outside_graph(path: Path) -> plt.Figure:
    """step_outside_graph.py's last interval per (shape, batch): each operation as a bar at its offset from the end
    of the previous graph replay."""
    cases = [(f"{shape} batch {batch}", entry["between_graphs"][-1])
             for shape, batches in json.loads(path.read_text())["results"].items()
             for batch, entry in batches.items() if entry.get("between_graphs")]
    fig, axes = plt.subplots(len(cases), 1, figsize=(9, 1.2 + 0.35 * max(len(g["ops"]) for _, g in cases) * len(cases)),
                             squeeze=False)
    for ax, (title, gap) in zip(axes[:, 0], cases):
        names = [name[:45] for _, _, name in gap["ops"]]
        ax.barh(range(len(names)), [d for _, d, _ in gap["ops"]], left=[o for o, _, _ in gap["ops"]])
        ax.set_yticks(range(len(names)))
        ax.set_yticklabels(names, fontsize=7)
        ax.invert_yaxis()
        ax.set_xlim(0, gap["gap_us"])
        ax.set_xlabel("us after the previous graph's last kernel (the next graph starts at the right edge)")
        ax.set_title(f"{title}: between two graph replays", fontsize=9)
    fig.tight_layout()
    return fig


def kernel_sequences(path: Path) -> plt.Figure:
    """One panel per (shape, batch) with a graph timeline: the kernels of its first 60 launches summed by name,
    microseconds (PDL off: each kernel's own time)."""
    data = json.loads(path.read_text())
    panels = []
    for key in ("moe_b256_pdl_off", "llama_3_8b_pdl_off", "moe_pdl_off"):
        for shape, contexts in data.get(key, {}).items():
            for entry in contexts.values():
                for b in entry["batches"]:
                    if "graph_timeline" in b:
                        panels.append((f"{shape} batch {b['batch']}", b["graph_timeline"]["sequence"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False)
    for ax, (title, sequence) in zip(axes[0], panels):
        totals: dict[str, float] = {}
        for name, us in sequence:
            short = name.split("<")[0].replace("void ", "")[:28]
            totals[short] = totals.get(short, 0.0) + us
        names = sorted(totals, key=totals.get)[-10:]
        ax.barh(names, [totals[n] for n in names])
        ax.set_xlabel("us in the first 60 kernels of a replay")
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="y", labelsize=6)
    fig.tight_layout()
    return fig


def persistent_down(path: Path) -> plt.Figure:
    """moe_persistent_down_h100_s37.json: per version, shape and tokens, the grid down GEMM against the best tile of
    the persistent one (each version was timed on its own machine)."""
    groups: dict[str, dict[str, float]] = {}
    for tag, run in json.loads(path.read_text())["runs"].items():
        for shape, rows in run["results"].items():
            for r in rows:
                timed = {k: v["us"] for k, v in r["configs"].items() if isinstance(v, dict)}
                g = groups.setdefault(f"{tag[:2]} {shape} {r['tokens']}", {})
                g["grid down GEMM"] = next(v for k, v in timed.items() if k.startswith("grid"))
                g["best persistent tile"] = min(v for k, v in timed.items() if k.startswith("persistent"))
    fig, ax = plt.subplots(figsize=(10, 3.8))
    grouped_bars(ax, groups, "us per fused_moe call", "fused MoE, grid vs persistent down GEMM (H100)")
    ax.tick_params(axis="x", labelrotation=45)
    return fig


def values_transposed(path: Path) -> plt.Figure:
    """gqa_values_transposed_h200_s37.json: per case, the engine's value layout against the best tiling of the
    transposed one (fp8_attention_kernels.py's 't' tiles)."""
    d = json.loads(path.read_text())
    groups: dict[str, dict[str, float]] = {}
    for part in ("kernels", "more_tilings"):
        for cases in d[part]["by_setting"].values():
            for case, rows in cases.items():
                timed = {k: v["us"] for k, v in rows.items() if isinstance(v, dict) and "us" in v}
                g = groups.setdefault(case, {})
                plain = min(v for k, v in timed.items() if not k.endswith("t"))
                best_t = min(v for k, v in timed.items() if k.endswith("t"))
                g["engine's layout"] = min(g.get("engine's layout", plain), plain)
                g["values transposed (best tiling)"] = min(g.get("values transposed (best tiling)", best_t), best_t)
    fig, ax = plt.subplots(figsize=(9, 3.8))
    grouped_bars(ax, groups, "us per decode-attention call", "GQA decode over E4M3: values transposed (H200)")
    ax.tick_params(axis="x", labelrotation=30)
    return fig


def main() -> None:
    figures = {
        "moe_align_ab_h200": lambda p: per_tokens(p, {"before_us": "before", "after_us": "one-program tile sized "
                                                                                   "to its pairs"}, "MoE align (H200)"),
        "mla_absorb_cap_sweep_h200": lambda p: steps_by_batch(p, "DeepSeek-V2-Lite decode step (H200): W_UK/W_UV "
                                                                  "as Triton GEMVs up to 4 or 16 rows"),
        "mla_absorb_ab_h200": lambda p: per_tokens(p, {"triton_us": "Triton GEMV pair", "cublas_us": "cuBLAS bmm pair"},
                                                   "V2-Lite W_UK + W_UV products per layer (H200)", x="batch"),
        "mla_absorb_mma_ab_h200": lambda p: per_tokens(p, {"gemv_us": "Triton GEMV pair", "mma_us": "Triton "
                                                           "tensor-core pair", "cublas_us": "cuBLAS bmm pair"},
                                                       "V2-Lite W_UK + W_UV products per layer (H200)", x="batch"),
        "mla_absorb_mma_steps_h200": lambda p: steps_by_batch(p, "DeepSeek-V2-Lite decode step (H200): W_UK/W_UV "
                                                                  "on the tensor-core Triton pair or cuBLAS"),
        "skinny_rows_ab_h200": lambda p: steps_by_batch(p, "decode steps (H200): skinny GEMM up to 16 or 32 rows"),
        "mla_decode_layouts_ab_h200": lambda p: mla_decode_ab(p, "MLA decode (V2-Lite, 1k context, H200): "
                                                                 "in-loop block ids / tokens-as-M vs before"),
        "mla_decode_reduce_ab_h200": lambda p: mla_decode_ab(p, "MLA decode (V2-Lite, 1k, H200): column-chunked "
                                                                "reduce vs before"),
        "mla_decode_few_rows_ab_h200": lambda p: mla_decode_ab(p, "MLA decode (V2-Lite, H200): one-tile 64-token "
                                                                  "splits at few rows vs before"),
        "mla_reduce_chunk_ab_h200": lambda p: mla_decode_ab(p, "MLA decode + reduce (V2-Lite, H200): 16 split rows "
                                                               "per reduce load vs 4 before"),
        "mla_decode_chunks_ab_h200": lambda p: mla_decode_ab(p, "MLA decode (V2-Lite, H200): latent in four "
                                                                "chunks vs before"),
        "session23_steps_ab_h200": lambda p: steps_by_batch(p, "DeepSeek-V2-Lite decode step (H200, 1k): chunked "
                                                               "MLA decode vs before"),
        "sink_attention_chunks_ab_h200": lambda p: per_tokens(p, {"before_us": "before", "now_us": "four column "
                                                                   "chunks"}, "V4.1 sink attention (H200)", x="rows"),
        "h200_b256_kernel_sequences": lambda p: kernel_sequences(p),
        "moe_align_single_ab_h200": lambda p: per_tokens(p, {"before_us": "three launches (memset, count, place)",
                                                             "after_us": "one program, atomics"}, "MoE align (H200)"),
        "h200_b128_b8_kernel_sequences": lambda p: kernel_sequences(p),
        "h200_b8_kernel_sequences_s25": lambda p: kernel_sequences(p),
        "mla_absorb_rows_ab_h200": lambda p: per_tokens(p, {"mma_us": "tensor-core pair, row blocks on the grid",
                                                            "cublas_us": "cuBLAS bmm pair"},
                                                        "V2-Lite W_UK + W_UV products per layer (H200)", x="batch"),
        "tune_moe_down_h200": lambda p: per_tokens(p, {"engine_pick_us": "engine pick", "best_us": "best down tiles"},
                                                   "fused MoE, down tiles varied (H200)"),
        "mla_decode_splits_h200": lambda p: mla_decode_ab(p, "MLA decode (V2-Lite, H200): engine pick vs the best "
                                                             "split x tile"),
        "moe_shared_blocks_ab_h200": lambda p: per_tokens(p, {"fused_us": "fused, shared blocks up to 64 rows "
                                                                          "(dropped)",
                                                              "fused_s23_us": "fused, shared blocks as the routed",
                                                              "module_us": "shared experts' own GEMMs"},
                                                          "MoE experts (H200)"),
        "session24_steps_ab_h200": lambda p: steps_by_batch(p, "decode steps (H200, 1k): session 24's changes, "
                                                               "switched back together and one by one"),
        "session25_steps_ab_h200": lambda p: steps_by_batch(p, "decode steps (H200, 1k): session 25's changes "
                                                               "against the code before each"),
        "moe_align_one_hot_ab_h200": lambda p: per_tokens(p, {"before_us": "one-hot program (small batches)",
                                                               "after_us": "one program with atomics"},
                                                           "MoE align (H200)"),
        "mla_decode_contiguous_h200": lambda p: mla_decode_ab(p, "MLA decode (V2-Lite, 1k, H200): each sequence's "
                                                                 "blocks in order"),
        "tune_skinny_split_h200": lambda p: tuning_best(p, "skinny GEMM at M = 8 / 32 (H200): cuBLAS, the unsplit "
                                                           "pick, the best tiling of the sweep (split_k 1-8)"),
        "tune_moe_down_h100_s35": lambda p: tuning_best(p, "fused MoE at 128 / 256 tokens, down tiles varied "
                                                           "(Qwen3-MoE, H100): engine pick against the best"),
        "tune_skinny_64rows_h100_s35": lambda p: tuning_best(p, "skinny GEMM at M = 64 (Llama-3.2-1B, H100): cuBLAS, "
                                                                "the engine's tiles, the best tiling (split_k 1-4)"),
        "tune_moe_decode_b8_h200": lambda p: tuning_best(p, "aligned fused MoE at 8 / 16 tokens (H200): engine pick "
                                                            "against the best tiles"),
        "session20_steps_ab_h200": lambda p: steps_by_batch(p, "decode steps (H200, 1k): session 20's changes, each "
                                                               "switched back"),
        "decode_merge_ab_h200": lambda p: per_tokens(p, {"reduce_launch_us": "split kernel + reduce launch",
                                                         "merge_in_kernel_us": "last split merges (dropped)"},
                                                     "paged decode (H200)", x="batch"),
        "moe_fused_align_ab_h200": lambda p: steps_by_batch(p, "DeepSeek-V2-Lite decode step (H200): MoE align fused "
                                                               "into the gate/up GEMM or not"),
        "router_gate_ab_h200": lambda p: per_tokens(p, {"triton_us": "split-K Triton + routing",
                                                        "cublas_us": "cuBLAS + routing"}, "gate GEMM + routing"),
        "moe_shared_fusion_ab_h200": lambda p: per_tokens(p, {"fused_us": "shared experts in the grouped GEMMs",
                                                              "module_us": "shared experts' own GEMMs"},
                                                          "MoE experts (H200)"),
        "fused_norm_rows_ab_h200": lambda p: steps_by_batch(p, "decode steps (H200, 1k): RMSNorms in the skinny "
                                                               "GEMM's K loop at 2-32 rows (dropped) vs main"),
        "ablate_rotary_ab_h200": lambda p: steps_by_batch(p, "decode steps (H200, 1k): the rotary + KV-write launch "
                                                             "skipped (diagnostic) vs the engine"),
        "decode_kv_prefetch_ab_h200": lambda p: steps_by_batch(p, "decode steps (H200, 1k): KV tiles prefetched to "
                                                                  "L2 before the PDL wait (dropped) vs main"),
        "gqa_in_step_qwen3_e4m3_h100_s36": lambda p: in_step_candidates(p, "paged GQA decode, Qwen3-MoE over E4M3 "
                                                                           "(H100, 1k, 48 layer caches, PDL off)"),
        "gqa_in_step_1b_bf16_h100_s36": lambda p: in_step_candidates(p, "paged GQA decode, Llama-3.2-1B over bf16 "
                                                                        "(H100, 1k, 16 layer caches, PDL off)"),
        "ncu_mla_wgmma_table_ahead_b256_h200_s56": lambda p: ncu_stalls(p, "wgmma MLA decode, V2-Lite batch 256 over "
                                                                           "E4M3 (H200, Nsight Compute): stalls"),
        "small_batch_tiles_1b_in_step_h100_s56": lambda p: in_step_candidates(p, "paged GQA decode, Llama-3.2-1B over "
                                                                              "bf16 (H100, PDL off): splits x tiles"),
        "cache_layout_in_step_h100_s56": lambda p: cache_layouts(p, "paged GQA decode over bf16 (H100, PDL off): "
                                                                    "slots- against heads-major cache blocks"),
        "cache_layout_in_step_e4m3_h100_s56": lambda p: cache_layouts(p, "paged GQA decode over E4M3 (H100, PDL off): "
                                                                         "slots- against heads-major cache blocks"),
        "decode_small_batch_in_step_h200": lambda p: decode_in_step(p, "paged GQA decode at small batch (H200, 1k, "
                                                                       "PDL off)"),
        "inflight_patch_ab_h200": lambda p: steps_by_batch(p, "decode steps (H200, 1k): the in-flight token patch "
                                                              "as one device copy vs the index path"),
        "step_outside_graph_h200": lambda p: outside_graph(p),
        "moe_persistent_down_h100_s37": persistent_down,
        "moe_align_gather_ab_h100_s37": lambda p: per_tokens(p, {"before_us": "scratch round trips + binary search",
                                                                 "after_us": "tl.gather + block stores"},
                                                             "one-program MoE align (H100)"),
        "gqa_values_transposed_h200_s37": values_transposed,
        "qk_norm_fusion_h200": lambda p: qk_norm_fusion(p),
        "skinny_pdl_ab_h200": lambda p: mode_ab(p, "skinny GEMM launch modes (H200)"),
        "moe_fused_combine_ab_h200": lambda p: mode_ab(p, "MoE pair mode: down + combine fused or apart (H200)"),
        "h200_moe_step_profiles": lambda p: step_profiles(p),
        "serve_vs_offline_cpu_xeon_amx": lambda p: serve_vs_offline(p),
    }
    only = set(sys.argv[1:])         # names to redraw (default: all)
    for name, draw in figures.items():
        if only and name not in only:
            continue
        path = HERE / f"{name}.json"
        if not path.exists():
            continue
        fig = draw(path)
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=110)
        plt.close(fig)
        print("wrote", path.with_suffix(".png"))


if __name__ == "__main__":
    main()
