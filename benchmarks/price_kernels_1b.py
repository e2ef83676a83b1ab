"""Price each kernel of a Llama-3.2-1B decode step against the bytes it must read: from a kernel table with PDL off
(`bash benchmarks/gpu_pending.sh kernel-table`: each kernel's duration is its own there), the median microseconds of
each launch of a layer (qkv, attention, o_proj, norm, gate/up + SwiGLU, down) against its weights' and KV cache's
bytes at the run's copy bandwidth, and what the step spends outside the 16 layers (the LM head, the last norm,
sampling). From a table with PDL on (recorded since session 44's profile_gpu_step) each launch also gets its exposed
time, what it adds to the step once the launches overlap (`exposed_us`); a layer then costs the step the sum of those
(`layer_exposed_us`), and the time outside the layers is counted from it. Usage:

    python benchmarks/price_kernels_1b.py benchmarks/kernel_table_1b_pdl0_h100_s44.json \
        --output benchmarks/price_kernels_1b_h100_s44.json

Writes the JSON and a PNG beside it (microseconds a layer, measured and at the copy bandwidth, per batch)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 2048, 8192, 32, 8, 64, 16, 128256
WEIGHT_BYTES = {        # bf16 weights a layer's launch reads
    "qkv": HIDDEN * (HEADS + 2 * KV_HEADS) * HEAD_DIM * 2,
    "o_proj": HEADS * HEAD_DIM * HIDDEN * 2,
    "gate_up": 2 * INTER * HIDDEN * 2,
    "down": INTER * HIDDEN * 2,
}
LM_HEAD_BYTES = VOCAB * HIDDEN * 2


def layer_roles(batch: int) -> list[str]:
    """A layer's launches in order, from its first: batch 1 runs the fused qkv + rotary + KV write and GEMVs (the
    input norm inside the qkv launch); more rows run the input norm, the qkv GEMM, then the rotary + KV write."""
    if batch == 1:
        return ["qkv", "attention", "o_proj", "norm", "gate_up", "down"]
    return ["norm", "qkv", "rotary_kv", "attention", "o_proj", "norm", "gate_up", "down"]


def first_layer_start(names: list[str], batch: int) -> int:
    if batch == 1:
        return names.index("_qkv_rotary_write_kernel")
    return names.index("_rotary_write_kv_kernel") - 2


def price(entry: dict, bandwidth: float) -> dict:
    batch, context = entry["batch"], entry["context"]
    timeline = entry["graph_timeline"]
    names = [n for n, _ in timeline["sequence"]]
    us = [u for _, u in timeline["sequence"]]
    roles = layer_roles(batch)
    start = first_layer_start(names, batch)
    cycles = [us[i:i + len(roles)] for i in range(start, len(us) - len(roles) + 1, len(roles))]
    # With PDL on, what each launch adds to the step (profile_gpu_step's exposed time; tables since session 44).
    exposed = timeline.get("sequence_exposed_us")
    exposed_cycles = ([exposed[i:i + len(roles)] for i in range(start, len(us) - len(roles) + 1, len(roles))]
                      if exposed else None)
    kv_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * 2
    rows = []
    for j, role in enumerate(roles):
        median = statistics.median(c[j] for c in cycles)
        nbytes = WEIGHT_BYTES.get(role, kv_bytes if role == "attention" else 0)
        rows.append({"role": role, "kernel": names[start + j], "us": round(median, 2), "bytes": nbytes,
                     "ideal_us": round(nbytes / bandwidth * 1e6, 2),
                     "TBps": round(nbytes / (median * 1e-6) / 1e12, 3) if nbytes else None})
        if exposed_cycles:
            rows[-1]["exposed_us"] = round(statistics.median(c[j] for c in exposed_cycles), 2)
    layer_us = sum(r["us"] for r in rows)
    # With PDL on the durations overlap (each includes its wait): a layer costs the step its exposed times' sum.
    cost_us = sum(r["exposed_us"] for r in rows) if exposed_cycles else layer_us
    out = {"batch": batch, "context": context, "step_ms": entry["step_ms"], "span_us": timeline["span_us"],
           "layer_cycles_seen": len(cycles), "layer": rows, "layer_us": round(layer_us, 1),
           "layer_ideal_us": round(sum(r["ideal_us"] for r in rows), 1),
           "outside_layers_us": round(timeline["span_us"] - LAYERS * cost_us, 1),
           "lm_head_ideal_us": round(LM_HEAD_BYTES / bandwidth * 1e6, 1)}
    if exposed_cycles:
        out["layer_exposed_us"] = round(cost_us, 1)
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(result["batches"]), figsize=(5 * len(result["batches"]), 4), squeeze=False)
    for ax, b in zip(axes[0], result["batches"]):
        labels = [r["role"] for r in b["layer"]]
        x = range(len(labels))
        ax.bar([i - 0.2 for i in x], [r["us"] for r in b["layer"]], 0.4, label="measured (PDL off)")
        ax.bar([i + 0.2 for i in x], [r["ideal_us"] for r in b["layer"]], 0.4, label="bytes / copy bandwidth")
        ax.set_xticks(list(x), labels, rotation=45, ha="right")
        ax.set_title(f"batch {b['batch']}: layer {b['layer_us']} us, ideal {b['layer_ideal_us']}")
        ax.set_ylabel("us a layer")
        ax.legend(fontsize=7)
    fig.suptitle(f"Llama-3.2-1B decode at 1k, one layer's kernels ({result['gpu']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("table", help="an h200_decode_sweep.py JSON of llama-3.2-1b with --timeline-batch (PDL off: "
                                  "the kernels' own durations; on: their exposed times too)")
    ap.add_argument("--output", required=True)
    args = ap.parse_args(argv)
    table = json.load(open(args.table))
    bandwidth = table["bandwidth_Bps"]
    entries = table["results"]["llama-3.2-1b"]["1024"]["batches"]
    result = {"command": "python " + " ".join(sys.argv), "source": args.table, "gpu": table["gpu"],
              "bandwidth_Bps": bandwidth, "batches": [price(e, bandwidth) for e in entries if "graph_timeline" in e]}
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, args.output.rsplit(".", 1)[0] + ".png")
    for b in result["batches"]:
        exposed = f", exposed {b['layer_exposed_us']} us" if "layer_exposed_us" in b else ""
        print(f"batch {b['batch']}: step {b['step_ms']} ms, layer {b['layer_us']} us{exposed} (ideal "
              f"{b['layer_ideal_us']}), outside the layers {b['outside_layers_us']} us (LM head ideal "
              f"{b['lm_head_ideal_us']})")
        for r in b["layer"]:
            print(f"   {r['role']:10s} {r['kernel'][:26]:26s} {r['us']:7.2f} us  ideal {r['ideal_us']:6.2f}  "
                  f"{r['TBps'] or '':>6} TB/s" + (f"  exposed {r['exposed_us']:6.2f} us" if "exposed_us" in r else ""))


if __name__ == "__main__":
    main()
