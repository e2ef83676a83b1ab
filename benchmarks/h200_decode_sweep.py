"""Decode steps at real batch sizes against their roofline: dense (Llama-3.2-1B, Llama-3-8B) and MoE
(DeepSeek-V2-Lite, Qwen3-MoE) shapes, random bf16 weights, one GPU, one run.

For every shape, context and batch size, `batch` random prompts of `context` tokens are prefilled, then decode
steps in which every sequence decodes are timed back to back (CUDA graphs, overlapped scheduling: what the engine
does when serving). Beside each step time, what the step must at least cost:

  bytes      the weights the step reads (dense: every layer and the LM head; MoE: everything but the routed
             experts, plus the distinct experts the batch touched, *counted* by the routers' load counters over
             probe steps after the timed ones) + each sequence's KV cache (context x bytes per token)
  flops      2 x active parameters per token + attention over the context, times the batch
  roofline   max(bytes / bandwidth, flops / 989 TFLOP/s)             -> fraction_of_roofline = roofline / step
             (bandwidth: a device-to-device copy measured at the start of the run, bytes read + written, so the
             ratios hold on whichever card ran it: about 4.24 TB/s on the H200, 3.0 on the H100)
  replay     the batch's captured CUDA graph replayed back to back: the forward's device time alone
  host_wait  per timed step, the host's wait for the device's result (the runner's collect): near 0 when the host
             sets the pace (its scheduling and batch building, not the device, then make the step time)
  experts    (MoE) max(distinct expert bytes / bandwidth, flops / peak): the issue's MoE target reads the
             step time against this one (within 1.5x); the full roofline above adds the KV and the other weights,
             and its ratio to this one (experts_ratio_floor) is the best the step could reach at full bandwidth

Plus, for the MoE shapes (all shapes with --profile-dense), a kernel table of the batch-64 step (torch.profiler over
graph replays; --profile-batch names other batch sizes): where it goes. --timeline-batch B: the idle time between the
kernels of batch B's graph replay, by the kernels around it (profile_gpu_step.graph_timeline).

Run (GPU machine):  python benchmarks/h200_decode_sweep.py --output benchmarks/h200_decode_sweep.json
Smoke (CPU):        python benchmarks/h200_decode_sweep.py --device cpu --shapes tiny-dense,tiny-moe \
                        --batches 1,4 --contexts 64 --steps 4 --output /tmp/sweep.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import h200_dense  # noqa: E402
import h200_moe  # noqa: E402
from deepserve import LLM, SamplingParams  # noqa: E402
from deepserve.bench.throughput import random_prompts  # noqa: E402

BANDWIDTH = 4.24e12          # H200 copy bandwidth, B/s; on a GPU, main() measures the card's own and uses that
PEAK_BF16 = 989e12           # H100 / H200 dense bf16 FLOP/s (the same chip)
BF16 = 2
MAX_BATCHED_TOKENS = 16384

TINY_MOE = dict(h200_moe.SHAPES["qwen3-moe"], hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
                intermediate_size=256, vocab_size=1024)
DENSE = {name: s for name, s in h200_dense.SHAPES.items() if name != "tiny"} | {"tiny-dense": h200_dense.SHAPES["tiny"]}
MOE = dict(h200_moe.SHAPES) | {"tiny-moe": TINY_MOE}


# --- what a step must cost ------------------------------------------------------------------------------------

def expert_bytes(s: dict) -> int:
    return 3 * s["hidden_size"] * s["moe_intermediate_size"] * BF16


def static_weight_bytes(name: str) -> int:
    """Weights every decode step reads whatever the batch: dense shapes all of them, MoE all but the routed
    experts (attention, dense layers, shared experts, routers, LM head)."""
    if name in DENSE:
        return h200_dense.decode_read_bytes(DENSE[name])
    w = h200_moe.active_weight_bytes(MOE[name])
    return w["total"] - w["routed_experts_top_k"]


# Bytes of one cached key / value / latent element: 2 (bf16), 1 with --kv-cache-dtype fp8 / fp8_e5m2.
KV_ELEM = {"auto": BF16, "bfloat16": BF16, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
kv_elem = BF16


def kv_bytes_per_token(name: str) -> int:
    if name in DENSE:
        return h200_dense.kv_bytes_per_token(DENSE[name], kv_elem)
    s = MOE[name]
    if "kv_lora_rank" in s:          # MLA: the latent and the rope key, one of each per token and layer
        return s["num_hidden_layers"] * (s["kv_lora_rank"] + s["qk_rope_head_dim"]) * kv_elem
    return s["num_hidden_layers"] * 2 * s["num_key_value_heads"] * s["head_dim"] * kv_elem


def flops_per_token(name: str, context: int) -> float:
    """2 x the active parameters a token multiplies + attention's scores and weighted sums over the context."""
    if name in DENSE:
        s = DENSE[name]
        active = h200_dense.decode_read_bytes(s) / BF16
        attn = 4 * s["num_attention_heads"] * s["head_dim"] * context * s["num_hidden_layers"]
        return 2 * active + attn
    s = MOE[name]
    active = h200_moe.active_weight_bytes(s)["total"] / BF16
    if "kv_lora_rank" in s:          # absorbed MLA: scores over latent + rope, sums over the latent
        per_key = s["kv_lora_rank"] * 2 + s["qk_rope_head_dim"]
        attn = 2 * s["num_attention_heads"] * per_key * context * s["num_hidden_layers"]
    else:
        attn = 4 * s["num_attention_heads"] * s["head_dim"] * context * s["num_hidden_layers"]
    return 2 * active + attn


def roofline(name: str, batch: int, context: float, touched_experts: float | None) -> dict:
    """Lower bounds of one decode step (seconds), `touched_experts` = distinct (layer, expert) pairs it reads."""
    weights = static_weight_bytes(name)
    experts = (touched_experts or 0) * expert_bytes(MOE[name]) if name in MOE else 0
    kv = batch * context * kv_bytes_per_token(name)
    flops = batch * flops_per_token(name, int(context))
    out = {"weight_bytes": weights, "expert_bytes": experts, "kv_bytes": round(kv), "flops": flops,
           "roofline_ms": round(max((weights + experts + kv) / BANDWIDTH, flops / PEAK_BF16) * 1e3, 4)}
    if name in MOE:
        out["experts_roofline_ms"] = round(max(experts / BANDWIDTH, flops / PEAK_BF16) * 1e3, 4)
    return out


# --- measuring ------------------------------------------------------------------------------------------------

def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def touched_experts(engine) -> float:
    """Distinct (layer, expert) pairs one step routed tokens to: the routers' load counters after one step."""
    layers = engine.runner.model.moe_layers()
    for layer in layers:
        layer.reset_expert_load()
    engine.step()
    return float(sum(int((layer.expert_load > 0).sum()) for layer in layers))


def decode_batch(llm: LLM, name: str, batch: int, context: int, steps: int, device: str,
                 probes: int = 3, timeline: bool = False) -> dict:
    """Time `steps` decode steps of `batch` sequences at `context` tokens; count the experts of `probes` more."""
    eng = llm.engine
    prompts = random_prompts(batch, context, eng.vocab_size, seed=batch * 7 + context)
    # Sequences whose prompts finish first decode while the others still prefill: room for those steps too.
    params = SamplingParams(temperature=0.0, max_tokens=steps + probes + 8 + prefill_steps(batch, context),
                            ignore_eos=True)
    ids = [f"sweep-{name}-{context}-{batch}-{i}" for i in range(batch)]
    try:
        for rid, prompt in zip(ids, prompts):
            eng.add_request(rid, prompt, params, final_output_only=True)
        seqs = [s for rid in ids for s in eng.requests[rid].seqs]
        t0 = time.perf_counter()
        while not all(s.num_output_tokens >= 1 for s in seqs):
            eng.step()
        prefill_s = time.perf_counter() - t0
        for _ in range(2):            # warm: the first decode step after prefill is not a steady one
            eng.step()
        sync(device)
        before = [s.num_output_tokens for s in seqs]
        tokens_at_start = sorted({s.num_tokens for s in seqs})     # where the timed steps cross block boundaries
        preempted = eng.scheduler.num_preemptions
        import profile_gpu_step
        waits = []
        stamps = []
        with profile_gpu_step.waits_for_device(eng.runner, waits):
            t0 = time.perf_counter()
            for _ in range(steps):
                eng.step()
                stamps.append(time.perf_counter())
            sync(device)
            elapsed = time.perf_counter() - t0
        grew = min(s.num_output_tokens - b for s, b in zip(seqs, before))
        context_mean = sum(s.num_tokens for s in seqs) / batch - steps / 2
        if eng.scheduler.num_preemptions != preempted or grew < steps - 1:
            raise RuntimeError(f"not a steady decode of {batch}: {grew} tokens per sequence in {steps} steps, "
                               f"{eng.scheduler.num_preemptions - preempted} preemptions")
        touched = None
        if name in MOE:
            touched = sum(touched_experts(eng) for _ in range(probes)) / probes
        replay = graph_replay_ms(eng, batch) if device == "cuda" else None
        if timeline and device == "cuda":
            import profile_gpu_step
            gaps = profile_gpu_step.graph_timeline(eng, batch)
    finally:
        eng.abort_request(ids)
    step_ms = elapsed / steps * 1e3
    roof = roofline(name, batch, context_mean, touched)
    # Each step's wall time between returns (steady, the device paces them): a median well under step_ms means a few
    # steps stalled (a host pause: the first H200 run of session 29 had V2-Lite batch 256 at 15.0 ms against an 11.7
    # ms graph replay, and 11.7 in the next run), and step_ms_max says how long.
    walls = [b - a for a, b in zip([t0] + stamps[:-1], stamps)]
    step_walls = sorted(walls)
    out = {"batch": batch, "context": round(context_mean, 1), "prefill_s": round(prefill_s, 3),
           "step_ms": round(step_ms, 4), "step_ms_median": round(step_walls[len(step_walls) // 2] * 1e3, 4),
           "step_ms_max": round(step_walls[-1] * 1e3, 4),
           "step_ms_each": [round(w * 1e3, 3) for w in walls],      # in order: a slow step's place (block crossings)
           "tokens_at_start": tokens_at_start[:8],
           "tokens_per_s": round(batch / step_ms * 1e3, 1), **roof,
           "fraction_of_roofline": round(roof["roofline_ms"] / step_ms, 4),
           "achieved_TBps": round((roof["weight_bytes"] + roof["expert_bytes"] + roof["kv_bytes"]) / step_ms / 1e9, 3)}
    if replay is not None:
        # The captured forward alone, back to back: step_ms - this = what the step spends outside the forward
        # (scheduling, sampling, the host's wait).
        out["graph_replay_ms"] = replay
    # The host's wait for the device's result, per step: near 0 means the host, not the device, set the pace.
    out["host_wait_ms"] = round(sum(waits) / steps * 1e3, 4)
    if timeline and device == "cuda":
        out["graph_timeline"] = gaps
    if touched is not None:
        out["touched_experts_per_step"] = touched
        out["experts_roofline_ratio"] = round(step_ms / roof["experts_roofline_ms"], 3)
        # The ratio a step reading every byte it must (weights, experts, KV) at the full bandwidth would get: the
        # floor of experts_roofline_ratio (at batch 256 and 1k context: 1.37 for V2-Lite, 1.52 for Qwen3-MoE, whose
        # KV there is 46% of its expert bytes).
        out["experts_ratio_floor"] = round(roof["roofline_ms"] / roof["experts_roofline_ms"], 3)
    return out


def graph_replay_ms(engine, batch: int, reps: int = 30) -> float | None:
    """The batch's captured graph replayed on the inputs the last step left (its sequences' real block tables and
    lengths), with every cache write sent to slot -1 (nowhere): the forward's device time alone."""
    import profile_gpu_step
    g = profile_gpu_step.ready_graph(engine, batch)
    if g is None:
        return None
    t0 = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    return round((time.perf_counter() - t0) / reps * 1e3, 4)


def prefill_steps(batch: int, context: int) -> int:
    return -(-batch * context // MAX_BATCHED_TOKENS) + 1


def profile_batch(llm: LLM, batch: int, context: int, steps: int = 5) -> dict:
    import profile_gpu_step
    return profile_gpu_step.profile_steps(llm, batch, steps, input_len=context)


def kv_fits(name: str, batch: int, context: int, budget_bytes: float) -> bool:
    return batch * (context + 64) * kv_bytes_per_token(name) <= budget_bytes


def write_shape_config(shape: dict, max_len: int, dense: bool = False) -> str:
    """A config folder for `shape` (h200_dense's or h200_moe's) whose max_position_embeddings holds max_len."""
    config = h200_dense.write_config(shape) if dense else h200_moe.write_config(shape)
    with open(os.path.join(config, "config.json")) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = max(cfg.get("max_position_embeddings", 0), max_len)   # room for 4k prompts
    with open(os.path.join(config, "config.json"), "w") as f:
        json.dump(cfg, f)
    return config


def run_shape(name: str, context: int, batches: list[int], args, result: dict) -> None:
    max_len = context + args.steps + 16 + prefill_steps(max(batches), context)
    # --max-model-len: an engine sized for longer sequences than the sweep runs (a deployment's default is the
    # model's context), whose per-step inputs (block tables) and graph grids follow max_model_len.
    max_len = max(max_len, args.max_model_len or 0)
    config = write_shape_config(DENSE[name] if name in DENSE else MOE[name], max_len, dense=name in DENSE)
    free = torch.cuda.mem_get_info()[0] if args.device == "cuda" else 8e9
    weights = (h200_dense.weight_bytes(DENSE[name]) if name in DENSE
               else h200_moe.active_weight_bytes(MOE[name])["total_weights_bytes"])
    budget = 0.8 * free - weights
    fit = [b for b in batches if kv_fits(name, b, context, budget)]
    entry = result["results"].setdefault(name, {}).setdefault(str(context), {})
    entry["skipped_batches_kv_too_big"] = [b for b in batches if b not in fit]
    if not fit:
        return
    kw = dict(load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", device=args.device,
              max_model_len=max_len, max_num_seqs=max(fit), max_num_batched_tokens=MAX_BATCHED_TOKENS,
              kv_cache_dtype=args.kv_cache_dtype)
    if args.device == "cuda":
        kw["gpu_memory_utilization"] = 0.85
    t0 = time.perf_counter()
    llm = LLM(config, **kw)
    entry["startup_s"] = round(time.perf_counter() - t0, 2)
    entry["cuda_graphs"] = llm.engine.runner.cuda_graphs is not None
    entry["batches"] = []
    for b in fit:
        try:
            entry["batches"].append(decode_batch(llm, name, b, context, args.steps, args.device,
                                                 timeline=b in args.timeline_batch))
        except Exception:
            entry["batches"].append({"batch": b, "error": traceback.format_exc()[-1500:]})
        print(name, context, json.dumps(entry["batches"][-1]), flush=True)
        save(result, args.output)
    profiled = args.profile_batch if (name in MOE or args.profile_dense) and args.device == "cuda" else []
    for b in [b for b in profiled if b in fit]:
        try:
            entry[f"profile_b{b}"] = profile_batch(llm, b, context)
        except Exception:
            entry[f"profile_b{b}"] = {"error": traceback.format_exc()[-1500:]}
        print(name, "profile", json.dumps(entry[f"profile_b{b}"])[:4000], flush=True)
    del llm
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    save(result, args.output)


def save(result: dict, path: str) -> None:
    """Written after every measurement: a run cut short keeps what it measured."""
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def plot(data: dict, path: str) -> None:
    """Step time over the roofline per batch size, one line per (shape, context)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    has_moe = any(name in MOE for name in data["results"])
    fig, axes = plt.subplots(1, 2 if has_moe else 1, figsize=(12 if has_moe else 6.5, 4.4), squeeze=False)
    left, right = axes[0][0], (axes[0][1] if has_moe else None)
    for name, by_ctx in data["results"].items():
        for ctx, entry in by_ctx.items():
            rows = [r for r in entry.get("batches", []) if "step_ms" in r]
            if not rows:
                continue
            b = [r["batch"] for r in rows]
            left.plot(b, [r["fraction_of_roofline"] for r in rows], "o-", label=f"{name} ctx {ctx}")
            if name in MOE:
                line, = right.plot(b, [r["experts_roofline_ratio"] for r in rows], "s-", label=f"{name} ctx {ctx}")
                if all("experts_ratio_floor" in r for r in rows):      # the best ratio at full bandwidth
                    right.plot(b, [r["experts_ratio_floor"] for r in rows], "--", c=line.get_color(), lw=1,
                               label=f"{name} floor (all bytes at full BW)")
    left.axhline(0.8, ls=":", c="gray")
    left.set_title("roofline (weights + experts touched + KV; FLOPs) / step time", fontsize=9)
    if has_moe:
        right.axhline(1.5, ls=":", c="gray")
        right.set_title("MoE: step time / max(distinct expert bytes / BW, FLOPs / peak)", fontsize=9)
    for ax in axes[0]:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("decode batch")
        ax.legend(fontsize=7)
    gpu = data.get("gpu", "H200").replace("NVIDIA ", "")
    fig.suptitle(f"decode steps on one {gpu} (copy bandwidth {data.get('bandwidth_Bps', BANDWIDTH) / 1e12:.2f} TB/s),"
                 f"\nrandom bf16 weights, KV cache {data.get('kv_cache_dtype', 'auto')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Description": data["command"]})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="deepseek-v2-lite,qwen3-moe,llama-3.2-1b,llama-3-8b")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--contexts", default="1024,4096", help="dense shapes; MoE shapes run the first only")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--profile-batch", type=lambda v: [int(b) for b in v.split(",")], default=[64],
                    help="comma-separated batch sizes with a kernel table")
    ap.add_argument("--profile-dense", action="store_true", help="kernel tables of the dense shapes too")
    ap.add_argument("--timeline-batch", type=lambda v: [int(b) for b in v.split(",") if b], default=[],
                    help="batch sizes whose graph replay gets an idle-time breakdown (profile_gpu_step.graph_timeline)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the engine's max_model_len when larger than the sweep needs (e.g. 131072, Llama-3's context)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=sorted(KV_ELEM),
                    help="the engines' kv_cache_dtype; the roofline counts its bytes (fp8: one a key/value element)")
    ap.add_argument("--output", default="benchmarks/h200_decode_sweep.json")
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG beside --output from its JSON")
    ap.add_argument("--skinny-max-rows", type=int, default=None,
                    help="A/B: decode GEMMs of up to this many rows on the skinny Triton GEMM, whatever their K "
                         "(engine: kernels/skinny_gemm.skinny_max_rows; 16 is the rule before 32 rows at K <= 2048)")
    args = ap.parse_args()
    global kv_elem
    kv_elem = KV_ELEM[args.kv_cache_dtype]
    if args.skinny_max_rows is not None:
        import deepserve.kernels.skinny_gemm as skinny_gemm
        skinny_gemm.SKINNY_MAX_ROWS = skinny_gemm.SKINNY_MAX_ROWS_SHORT_K = args.skinny_max_rows
    if args.plot_only:
        with open(args.output) as f:
            plot(json.load(f), args.output.removesuffix(".json") + ".png")
        return
    global BANDWIDTH
    copy = None
    if args.device == "cuda":
        copy = h200_dense.copy_bandwidth("cuda", 4 << 30)
        BANDWIDTH = copy["measured_Bps"]
        print("copy bandwidth", copy, flush=True)
    result = {"command": "python " + " ".join(sys.argv), "torch": torch.__version__,
              "kv_cache_dtype": args.kv_cache_dtype,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "bandwidth_Bps": BANDWIDTH, "copy_bandwidth": copy, "peak_bf16_flops": PEAK_BF16, "results": {}}
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    for name in args.shapes.split(","):
        for context in (contexts if name in DENSE else contexts[:1]):
            try:
                run_shape(name, context, batches, args, result)
            except Exception:
                result["results"].setdefault(name, {})[str(context)] = {"error": traceback.format_exc()[-2000:]}
                print(name, context, result["results"][name][str(context)], flush=True)
            save(result, args.output)
    if args.device == "cuda":
        plot(result, args.output.removesuffix(".json") + ".png")


if __name__ == "__main__":
    main()
