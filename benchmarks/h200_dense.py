"""deepserve vs HF transformers on one GPU, random bf16 weights of real dense shapes, everything in one run.

Per shape (Llama-3.2-1B, Llama-3-8B; `tiny` is a 2-layer shape for smoke runs):

  deepserve (default engine: CUDA graphs where the engine has them)
    startup           wall time of LLM(...) (load + KV profiling + graph capture) and the engine's own timings
                      (`runner.*_seconds`, e.g. the graph-capture time, when the engine exposes them)
    latency_b1/_b32   `bench latency` numbers (prefill time, per-step time, tokens/s), 128 in / 128 out
    decode_b64_ctx1k  64 prompts of 1024 tokens, 64 new tokens; only steps in which all 64 sequences decode
                      are timed -> achieved bandwidth = (weight bytes + KV bytes read per step) / step time
    throughput        offline, 256 prompts x 128 in / 128 out, greedy (`run_throughput`)
  deepserve_eager     `enforce_eager=True`, batch 1 (first shape only): graphs vs eager
  hf_transformers     sdpa; `generate` at batch 1 (new tokens capped on big shapes) and batch 32, and
                      `generate_batch` (continuous batching) on the offline workload
  summary             roofline fractions, deepserve/HF ratios, and the targets with pass/fail

Roofline: batch-1 decode must read every weight once per token, so tokens/s <= copy bandwidth / weight bytes.
The stated copy bandwidth is 4.26e12 B/s; the `machine` phase also measures it (a big device-to-device copy,
bytes read + written) and the summary reports the roofline for both.

Each (shape, engine) runs in a subprocess of its own: a crash or a sticky CUDA error costs that phase only, and
all GPU memory is back before the next engine. Inside a phase every measurement has its own try/except (the
traceback tail lands in the JSON) and the JSON is rewritten after every phase. Measurements that would start
after --time-limit are skipped and say so. Engines run most-important first: deepserve, then eager, then HF.

Run (GPU, ~5 min):   python benchmarks/h200_dense.py
Smoke (GPU, ~1 min): python benchmarks/h200_dense.py --quick --output /tmp/h200_quick.json
Smoke (CPU):         python benchmarks/h200_dense.py --device cpu --quick --shapes tiny --output /tmp/tiny.json
Plan only:           python benchmarks/h200_dense.py --dry-run
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:   # run as `python benchmarks/h200_dense.py` without installing deepserve
    sys.path.insert(0, ROOT)

STATED_COPY_BANDWIDTH = 4.26e12   # B/s, H200 device-to-device copy (read + write)

SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=8192, vocab_size=128256, head_dim=64, tie_word_embeddings=True),
    "llama-3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, vocab_size=128256, head_dim=128, tie_word_embeddings=False),
    "tiny": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=512, vocab_size=2048, head_dim=64, tie_word_embeddings=True),
}

# Targets of the acceptance: batch-1 decode at >= 70% of the roofline (stated bandwidth), offline output
# throughput >= 20x HF generate_batch, start-up < 60 s.
TARGETS = {"batch1_fraction_of_roofline": 0.70, "offline_vs_hf_generate_batch": 20.0, "startup_s": 60.0,
           "batch1_tokens_per_s": {"llama-3.2-1b": 1200.0, "llama-3-8b": 185.0}}

# Names of the paged SDPA attention across transformers versions: 5.x before 5.23 registers "paged|sdpa",
# late 4.x "sdpa_paged", 5.23+ takes plain "sdpa" for continuous batching.
CB_ATTN_IMPLEMENTATIONS = ("paged|sdpa", "sdpa_paged", "sdpa")

# Where the engine may report its CUDA-graph capture time (the first one found wins; None when absent).
CAPTURE_KEYS = ("runner.cuda_graph_capture_seconds", "runner.cuda_graphs.capture_seconds",
                "runner.graph_capture_seconds", "runner.capture_seconds", "engine.cuda_graph_capture_seconds")

ENGINES = ("deepserve", "deepserve_eager", "hf_transformers")


@dataclasses.dataclass(frozen=True)
class Workload:
    b1_in: int = 128
    b1_out: int = 128
    b32: int = 32
    b32_in: int = 128
    b32_out: int = 128
    ctx_batch: int = 64
    ctx_in: int = 1024
    ctx_out: int = 64
    offline_prompts: int = 256
    offline_in: int = 128
    offline_out: int = 128
    hf_b1_tokens: int = 128
    hf_b1_tokens_big: int = 32         # HF batch-1 decode of an 8B shape runs at ~20-40 tok/s: cap it
    copy_bytes: int = 4 << 30


FULL = Workload()
QUICK = Workload(b1_in=16, b1_out=16, b32=4, b32_in=16, b32_out=16, ctx_batch=4, ctx_in=128, ctx_out=8,
                 offline_prompts=16, offline_in=16, offline_out=16, hf_b1_tokens=8, hf_b1_tokens_big=8,
                 copy_bytes=64 << 20)


# --- shapes and bytes ---------------------------------------------------------------------------------------

def write_config(shape: dict) -> str:
    d = tempfile.mkdtemp(prefix="dense-shape-")
    # No bos/eos ids: random weights must never stop early (LlamaConfig would default eos to 2).
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", max_position_embeddings=4096,
               rms_norm_eps=1e-5, rope_theta=500000.0, torch_dtype="bfloat16", hidden_act="silu",
               bos_token_id=None, eos_token_id=None, pad_token_id=None, **shape)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def _layer_params(s: dict) -> int:
    h, hd = s["hidden_size"], s["head_dim"]
    attn = h * s["num_attention_heads"] * hd * 2 + h * s["num_key_value_heads"] * hd * 2   # q, o; k, v
    return attn + 3 * h * s["intermediate_size"]                                          # gate, up, down


def weight_bytes(s: dict, elem: int = 2) -> int:
    """All parameters (the acceptance's roofline: its 1B/8B token targets are 70% of bandwidth / this)."""
    embed = s["vocab_size"] * s["hidden_size"]
    head = 0 if s["tie_word_embeddings"] else embed
    return elem * (s["num_hidden_layers"] * _layer_params(s) + embed + head)


def decode_read_bytes(s: dict, elem: int = 2) -> int:
    """What one decode step must read: the layers and the LM head; the embedding gives one row per token
    (differs from weight_bytes only for untied embeddings, e.g. 8B: 15.0 GB vs 16.1 GB)."""
    return elem * (s["num_hidden_layers"] * _layer_params(s) + s["vocab_size"] * s["hidden_size"])


def kv_bytes_per_token(s: dict, elem: int = 2) -> int:
    return s["num_hidden_layers"] * 2 * s["num_key_value_heads"] * s["head_dim"] * elem


def is_big(s: dict) -> bool:
    return weight_bytes(s) > 8e9


# --- phase harness (runs in the subprocess) ---------------------------------------------------------------

def error_tail(limit: int = 2000) -> str:
    return traceback.format_exc()[-limit:]


class Phase:
    """The measurements of one (shape, engine) phase: each guarded on its own, saved after each one."""

    def __init__(self, out_path: str, deadline: float) -> None:
        self.out_path, self.deadline, self.data = out_path, deadline, {}

    def measure(self, key: str, fn: Callable[[], Any]) -> Any:
        """data[key] = fn(), or {'error': traceback tail}, or {'skipped': why}. Returns None unless fn ran."""
        value = None
        if time.time() > self.deadline:
            self.data[key] = {"skipped": "time limit reached before this measurement"}
        else:
            t0 = time.perf_counter()
            try:
                value = self.data[key] = fn()
            except Exception:   # one failing measurement must not lose the others
                self.data[key] = {"error": error_tail(), "after_s": round(time.perf_counter() - t0, 1)}
        print(f"{key}: {json.dumps(self.data[key], default=str)[:1500]}", flush=True)
        self.save()
        return value

    def skip(self, keys: tuple[str, ...], why: str) -> None:
        for key in keys:
            self.data[key] = {"skipped": why}
        self.save()

    def save(self) -> None:
        with open(self.out_path, "w") as f:
            json.dump(self.data, f, indent=1, default=str)


def sync(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free_memory(device: str) -> dict:
    """Give cached GPU memory back and report what is still held (non-zero means a leak)."""
    import torch
    gc.collect()
    if not device.startswith("cuda"):
        return {}
    torch.cuda.empty_cache()
    return {"gpu_allocated_after_free_GiB": round(torch.cuda.memory_allocated() / 2**30, 3),
            "gpu_reserved_after_free_GiB": round(torch.cuda.memory_reserved() / 2**30, 3)}


def dtype_name(device: str) -> str:
    # bf16 on the GPU (the acceptance); fp32 on the CPU, where bf16 matrix products are slow and the run is a
    # smoke test anyway.
    return "bfloat16" if device.startswith("cuda") else "float32"


def elem_bytes(device: str) -> int:
    return 2 if device.startswith("cuda") else 4


# --- machine phase ----------------------------------------------------------------------------------------

def phase_machine(ph: Phase, args, wl: Workload) -> None:
    ph.measure("versions", versions)
    ph.measure("copy_bandwidth", lambda: copy_bandwidth(args.device, wl.copy_bytes))


def versions() -> dict:
    from importlib import metadata

    from deepserve.bench.throughput import machine_info
    info = machine_info()
    for pkg in ("torch", "triton", "transformers", "matplotlib"):
        try:
            info[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            info[pkg] = None
    return info


def copy_bandwidth(device: str, nbytes: int, reps: int = 10) -> dict:
    """Device-to-device copy; bandwidth counts bytes read + written (how the 4.26e12 figure is quoted)."""
    import torch
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        sync(device)
        best = min(best, (time.perf_counter() - t0) / reps)
    del src, dst
    free_memory(device)
    return {"bytes_copied": nbytes, "seconds_per_copy": round(best, 6),
            "measured_Bps": round(2 * nbytes / best, -6)}


# --- deepserve phases -------------------------------------------------------------------------------------

def deepserve_kwargs(args) -> dict:
    kw = dict(load_format="dummy", skip_tokenizer_init=True, dtype=dtype_name(args.device), device=args.device,
              max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=8192)
    if args.device.startswith("cuda"):
        # Half the GPU is ample (8B: ~9 GB of KV for 64 x 1088 tokens) and leaves room should memory leak.
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    return kw


def _runner(llm):
    engine = getattr(llm, "llm_engine", None) or getattr(llm, "engine", None)
    return engine, getattr(engine, "runner", None)


def _plain_attributes(obj, label: str, wanted: Callable[[str], bool]) -> dict:
    """Public attributes of obj that `wanted` picks and that are plain numbers, strings or short int lists."""
    found = {}
    for name in dir(obj) if obj is not None else ():
        if name.startswith("_") or not wanted(name):
            continue
        try:
            value = getattr(obj, name)
        except Exception:   # a property may fail; it is only a report
            continue
        if isinstance(value, (bool, int, float, str)) or (
                isinstance(value, (list, tuple)) and len(value) <= 64 and all(isinstance(v, int) for v in value)):
            found[f"{label}.{name}"] = value
    return found


def engine_timings(llm) -> dict:
    """The engine's own start-up report, whatever it exposes: `*_seconds` / `*_bytes` attributes of the
    engine and runner, and the CUDA-graph runner's plain attributes (capture sizes, capture time)."""
    def timing(name: str) -> bool:
        return name.endswith(("_seconds", "_bytes")) or "graph" in name

    engine, runner = _runner(llm)
    found = {**_plain_attributes(engine, "engine", timing), **_plain_attributes(runner, "runner", timing),
             **_plain_attributes(getattr(runner, "cuda_graphs", None), "runner.cuda_graphs", lambda _: True)}
    capture = next((found[k] for k in CAPTURE_KEYS if isinstance(found.get(k), (int, float))), None)
    return {"cuda_graph_capture_s": round(capture, 2) if capture is not None else None,
            "cuda_graphs": getattr(runner, "cuda_graphs", None) is not None, "engine_attributes": found}


def graph_replays(llm) -> int | None:
    return getattr(getattr(_runner(llm)[1], "cuda_graphs", None), "num_replays", None)


def with_replays(llm, fn: Callable[[], dict]) -> dict:
    """fn()'s result plus how many decode steps replayed a CUDA graph meanwhile (None: no graph runner)."""
    before = graph_replays(llm)
    result = fn()
    after = graph_replays(llm)
    result["cuda_graph_replays"] = after - before if before is not None and after is not None else None
    return result


def triton_cache_files() -> int | None:
    """Kernels already compiled on disk: a cold cache makes the first engine's start-up longer."""
    path = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")
    return sum(len(files) for _, _, files in os.walk(path)) if os.path.isdir(path) else 0


def start_engine(args, path: str, holder: dict, **extra) -> dict:
    from deepserve import LLM
    kwargs = {**deepserve_kwargs(args), **extra}
    cache_before = triton_cache_files()
    t0 = time.perf_counter()
    holder["llm"] = LLM(path, **kwargs)
    startup = time.perf_counter() - t0
    return {"startup_s": round(startup, 2), **engine_timings(holder["llm"]), "engine_kwargs": kwargs,
            "triton_cache_files_before": cache_before}


def phase_deepserve(ph: Phase, args, wl: Workload, shape: dict, path: str) -> None:
    later = ("latency_b1", "latency_b32", "decode_b64_ctx1k", "throughput")
    holder: dict = {}
    ph.measure("startup", lambda: start_engine(args, path, holder))
    if "llm" not in holder:
        return ph.skip(later, "the engine did not start")
    llm = holder.pop("llm")
    try:
        _deepserve_measurements(ph, llm, args, wl, shape)
    finally:
        del llm
        ph.data["memory"] = free_memory(args.device)
        ph.save()


def _deepserve_measurements(ph: Phase, llm, args, wl: Workload, shape: dict) -> None:
    from deepserve.bench.throughput import run_latency, run_throughput
    # A seed per measurement: equal seeds would give equal first prompts, i.e. prefix-cache hits.
    ph.measure("latency_b1", lambda: with_replays(llm, lambda: run_latency(llm, 1, wl.b1_in, wl.b1_out, seed=1)))
    ph.measure("latency_b32", lambda: with_replays(llm, lambda: run_latency(llm, wl.b32, wl.b32_in, wl.b32_out,
                                                                             seed=2)))
    ph.measure("decode_b64_ctx1k", lambda: with_replays(llm, lambda: decode_at_context(llm, args, wl, shape)))
    ph.measure("throughput", lambda: with_replays(llm, lambda: run_throughput(
        llm, wl.offline_prompts, wl.offline_in, wl.offline_out, seed=4, temperature=0.0)))


def decode_at_context(llm, args, wl: Workload, shape: dict) -> dict:
    """Batch-64 decode over 1k-token contexts: the bytes a step reads are the weights plus every sequence's KV,
    so step time -> achieved bandwidth. run_latency times only steps where all 64 sequences decode."""
    from deepserve.bench.throughput import run_latency
    r = run_latency(llm, wl.ctx_batch, wl.ctx_in, wl.ctx_out, seed=3)
    elem = elem_bytes(args.device)
    context = r.get("mean_context_len") or wl.ctx_in + wl.ctx_out / 2
    kv = int(wl.ctx_batch * context * kv_bytes_per_token(shape, elem))
    weights = decode_read_bytes(shape, elem)
    r.update(weight_bytes_per_step=weights, kv_bytes_per_step=kv)
    if r.get("decode_ms_per_step"):
        r["achieved_Bps"] = round((weights + kv) / (r["decode_ms_per_step"] / 1e3), -6)
    return r


def _eager_measurements(ph: Phase, llm, wl: Workload) -> None:
    from deepserve.bench.throughput import run_latency
    ph.measure("latency_b1", lambda: with_replays(llm, lambda: run_latency(llm, 1, wl.b1_in, wl.b1_out, seed=1)))


def phase_deepserve_eager(ph: Phase, args, wl: Workload, shape: dict, path: str) -> None:
    holder: dict = {}

    def start() -> dict:
        try:
            return start_engine(args, path, holder, enforce_eager=True)
        except TypeError as e:   # the engine argument is being added: say so rather than fail obscurely
            return {"error": f"enforce_eager not accepted: {e}", "traceback": error_tail(800)}

    ph.measure("startup", start)
    if "llm" not in holder:
        return ph.skip(("latency_b1",), "the eager engine did not start")
    llm = holder.pop("llm")
    try:
        _eager_measurements(ph, llm, wl)
    finally:
        del llm
        ph.data["memory"] = free_memory(args.device)
        ph.save()


# --- HF transformers phase --------------------------------------------------------------------------------

def hf_load(path: str, device: str, attn: str = "sdpa") -> tuple[Any, str]:
    """The model with random weights on `device`, and how it was built."""
    import torch
    import transformers
    config = transformers.AutoConfig.from_pretrained(path)
    kwargs = {"dtype": getattr(torch, dtype_name(device)), "attn_implementation": attn}
    try:
        # Built on the device directly: random init of billions of parameters on the CPU takes minutes.
        with torch.device(device):
            model, how = transformers.AutoModelForCausalLM.from_config(config, **kwargs), "built on the device"
    except Exception as e:   # a version that ignores or refuses the device context: the slow way
        model = transformers.AutoModelForCausalLM.from_config(config, **kwargs).to(device)
        how = f"built on the CPU, then moved ({type(e).__name__}: {e})"[:300]
    model.generation_config.eos_token_id = None    # random weights: never stop early
    return model.eval(), how


def _timed_generate(model, ids, new_tokens: int, device: str) -> float:
    import torch
    sync(device)
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                   min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    sync(device)
    return time.perf_counter() - t0


def hf_generate_b1(model, vocab: int, prompt_len: int, new_tokens: int, device: str) -> dict:
    """Decode tokens/s = (N - 1) / (time of N new tokens - time of 1): the prompt's prefill cancels out."""
    import torch
    ids = torch.randint(100, vocab, (1, prompt_len), device=device)
    _timed_generate(model, ids, 4, device)   # warm-up
    first = _timed_generate(model, ids, 1, device)
    total = _timed_generate(model, ids, new_tokens, device)
    return {"prompt_len": prompt_len, "new_tokens": new_tokens, "time_1_token_s": round(first, 4),
            "total_s": round(total, 3), "decode_tokens_per_s": round((new_tokens - 1) / (total - first), 2),
            "output_tokens_per_s": round(new_tokens / total, 2)}


def hf_generate_batched(model, vocab: int, batch: int, prompt_len: int, new_tokens: int, device: str) -> dict:
    import torch
    ids = torch.randint(100, vocab, (batch, prompt_len), device=device)
    _timed_generate(model, ids[:, :8], 2, device)   # warm-up
    elapsed = _timed_generate(model, ids, new_tokens, device)
    return {"batch_size": batch, "input_len": prompt_len, "output_len": new_tokens, "elapsed_s": round(elapsed, 3),
            "output_tokens_per_s": round(batch * new_tokens / elapsed, 2)}


def hf_generate_batch(model, vocab: int, wl: Workload, device: str) -> dict:
    """transformers' continuous batching (`generate_batch`) on the offline workload. Tries each name of the
    paged SDPA attention in turn and records which one worked and why the others failed."""
    from deepserve.bench.throughput import random_prompts
    prompts = [p["prompt_token_ids"] for p in random_prompts(wl.offline_prompts, wl.offline_in, vocab, seed=4)]
    failures = {}
    for attn in CB_ATTN_IMPLEMENTATIONS:
        try:
            model.set_attn_implementation(attn)
            _run_generate_batch(model, prompts[:8], 4, device)   # warm-up (kernels, allocator)
            elapsed, outputs = _run_generate_batch(model, prompts, wl.offline_out, device)
        except Exception:
            failures[attn] = error_tail(800)
            continue
        tokens = sum(len(o.generated_tokens) for o in outputs)
        return {"attn_implementation": attn, "num_prompts": len(prompts), "input_len": wl.offline_in,
                "output_len": wl.offline_out, "elapsed_s": round(elapsed, 3), "output_tokens": tokens,
                "failed_requests": sum(1 for o in outputs if getattr(o, "error", None)),
                "output_tokens_per_s": round(tokens / elapsed, 2), "failed_attn_implementations": failures,
                "note": "elapsed includes generate_batch's per-call set-up (paged cache, its own warm-up)"}
    raise RuntimeError("generate_batch failed with every attention name:\n" + json.dumps(failures, indent=1))


def _run_generate_batch(model, prompts: list[list[int]], new_tokens: int, device: str) -> tuple[float, list]:
    from transformers import GenerationConfig
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
    sync(device)
    t0 = time.perf_counter()
    result = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False,
                                  **_cpu_cb_config(device))
    sync(device)
    elapsed = time.perf_counter() - t0
    outputs = list(result.values()) if isinstance(result, dict) else list(result)
    if len(outputs) != len(prompts):
        raise RuntimeError(f"generate_batch returned {len(outputs)} results for {len(prompts)} prompts")
    return elapsed, outputs


def _cpu_cb_config(device: str) -> dict:
    """On the CPU (smoke runs only) a small paged cache: sizing it from free RAM, the default, costs 20-40 s
    per call. On the GPU the defaults stand: that is what a user of generate_batch gets."""
    if device.startswith("cuda"):
        return {}
    try:
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError:
        return {}
    return {"continuous_batching_config": ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=512)}


def phase_hf(ph: Phase, args, wl: Workload, shape: dict, path: str) -> None:
    later = ("generate_b1", "generate_b32", "generate_batch")
    holder: dict = {}

    def load() -> dict:
        import transformers
        t0 = time.perf_counter()
        holder["model"], how = hf_load(path, args.device)
        return {"load_s": round(time.perf_counter() - t0, 2), "transformers": transformers.__version__,
                "attn_implementation": "sdpa", "dtype": dtype_name(args.device), "init": how,
                "device": str(next(holder["model"].parameters()).device)}

    ph.measure("load", load)
    if "model" not in holder:
        return ph.skip(later, "the HF model did not load")
    model = holder.pop("model")
    try:
        _hf_measurements(ph, model, args, wl, shape)
    finally:
        del model
        ph.data["memory"] = free_memory(args.device)
        ph.save()


def _hf_measurements(ph: Phase, model, args, wl: Workload, shape: dict) -> None:
    import torch
    vocab, device = shape["vocab_size"], args.device
    b1_tokens = wl.hf_b1_tokens_big if is_big(shape) else wl.hf_b1_tokens
    with torch.inference_mode():
        ph.measure("generate_b1", lambda: {**hf_generate_b1(model, vocab, wl.b1_in, b1_tokens, device),
                                           "new_tokens_capped": b1_tokens < wl.hf_b1_tokens})
        ph.measure("generate_b32", lambda: hf_generate_batched(model, vocab, wl.b32, wl.b32_in, wl.b32_out, device))
    # Outside inference_mode: generate_batch runs its own loop (a thread, possibly CUDA graphs) under no_grad.
    ph.measure("generate_batch", lambda: hf_generate_batch(model, vocab, wl, device))


PHASES = {"machine": phase_machine, "deepserve": phase_deepserve, "deepserve_eager": phase_deepserve_eager,
          "hf_transformers": phase_hf}


def run_phase(args) -> None:
    """Subprocess entry: one phase, results into --phase-out."""
    wl = QUICK if args.quick else FULL
    ph = Phase(args.phase_out, args.deadline)
    if args.phase == "machine":
        phase_machine(ph, args, wl)
        return
    shape = SHAPES[args.shapes]
    PHASES[args.phase](ph, args, wl, shape, write_config(shape))


# --- parent: the plan, the subprocesses, the summary --------------------------------------------------------

def plan_phases(args) -> list[tuple[str, str | None]]:
    """(engine, shape) in order of importance: every deepserve engine first, then eager, then HF."""
    shapes, engines = args.shapes.split(","), args.engines.split(",")
    phases: list[tuple[str, str | None]] = [("machine", None)]
    phases += [("deepserve", s) for s in shapes if "deepserve" in engines]
    phases += [("deepserve_eager", shapes[0])] if "deepserve_eager" in engines else []
    phases += [("hf_transformers", s) for s in shapes if "hf_transformers" in engines]
    return phases


def spawn_phase(args, engine: str, shape: str | None, deadline: float) -> dict:
    """Run one phase in a subprocess, echo its output, return what it saved (plus how it ended)."""
    fd, out = tempfile.mkstemp(prefix=f"phase-{engine}-", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", engine, "--phase-out", out,
           "--deadline", repr(deadline), "--device", args.device,
           "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    cmd += ["--shapes", shape] if shape else []
    cmd += ["--quick"] if args.quick else []
    tag = f"[{engine}{':' + shape if shape else ''}]"
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    # A hung phase must not hang the run: kill it after --phase-timeout, or 2 minutes past the deadline.
    timeout = min(args.phase_timeout, max(60.0, deadline + 120 - time.time()))
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    tail: collections.deque[str] = collections.deque(maxlen=30)
    for line in proc.stdout:
        print(tag, line, end="", flush=True)
        tail.append(line)
    rc = proc.wait()
    killer.cancel()
    with open(out) as f:
        text = f.read()
    os.unlink(out)
    data = json.loads(text) if text.strip() else {}
    data["phase_s"] = round(time.perf_counter() - t0, 1)
    if rc != 0:
        data["phase_failed"] = {"returncode": rc, "killed_after_timeout_s": timeout if rc == -9 else None,
                                "output_tail": "".join(tail)[-3000:]}
    return data


def num(d: Any, *keys: str) -> float | None:
    """d[k1][k2]... when it is a number, else None (a measurement may have failed or been skipped)."""
    for k in keys:
        d = d.get(k) if isinstance(d, dict) else None
    return d if isinstance(d, (int, float)) and not isinstance(d, bool) else None


def ratio(a: float | None, b: float | None, digits: int = 2) -> float | None:
    return round(a / b, digits) if a is not None and b else None


def target(value: float | None, goal: float, at_least: bool = True) -> dict:
    ok = None if value is None else (value >= goal if at_least else value < goal)
    return {"value": value, "target": (">= " if at_least else "< ") + str(goal), "pass": ok}


def summarize(name: str, entry: dict, measured_bw: float | None, elem: int) -> dict:
    """Roofline fractions, bandwidths, ratios and targets from whatever measurements succeeded."""
    shape = SHAPES[name]
    ds, eager, hf = (entry.get(k) or {} for k in ENGINES)
    wbytes, rbytes = weight_bytes(shape, elem), decode_read_bytes(shape, elem)
    roof = STATED_COPY_BANDWIDTH / wbytes
    b1 = num(ds, "latency_b1", "decode_tokens_per_s")
    ds_b32 = num(ds, "latency_b32", "output_tokens_per_s")
    offline = num(ds, "throughput", "output_tokens_per_s")
    hf_cb = num(hf, "generate_batch", "output_tokens_per_s")
    startup = num(ds, "startup", "startup_s")
    fraction = ratio(b1, roof, 3)
    s = {
        "batch1_roofline_tokens_per_s": round(roof, 1),
        "batch1_roofline_tokens_per_s_measured_bw": round(measured_bw / wbytes, 1) if measured_bw else None,
        "deepserve_batch1_tokens_per_s": b1,
        "deepserve_batch1_fraction_of_roofline": fraction,
        "deepserve_batch1_fraction_of_roofline_measured_bw": ratio(b1 * wbytes if b1 else None, measured_bw, 3),
        "deepserve_batch1_achieved_Bps": round(b1 * rbytes, -6) if b1 else None,
        "deepserve_b64_ctx1k_achieved_Bps": num(ds, "decode_b64_ctx1k", "achieved_Bps"),
        "deepserve_b64_ctx1k_fraction_of_measured_bw": ratio(num(ds, "decode_b64_ctx1k", "achieved_Bps"),
                                                             measured_bw, 3),
        "deepserve_startup_s": startup,
        "deepserve_cuda_graph_capture_s": num(ds, "startup", "cuda_graph_capture_s"),
        "eager_batch1_tokens_per_s": num(eager, "latency_b1", "decode_tokens_per_s"),
        "graphs_vs_eager_batch1": ratio(b1, num(eager, "latency_b1", "decode_tokens_per_s")),
        "ratio_batch1_vs_hf_generate": ratio(b1, num(hf, "generate_b1", "decode_tokens_per_s")),
        "ratio_batch32_vs_hf_generate": ratio(ds_b32, num(hf, "generate_b32", "output_tokens_per_s")),
        "ratio_offline_vs_hf_generate_batch": ratio(offline, hf_cb),
        "ratio_offline_vs_hf_generate_b32": ratio(offline, num(hf, "generate_b32", "output_tokens_per_s")),
    }
    s["targets"] = {
        "batch1_fraction_of_roofline": target(fraction, TARGETS["batch1_fraction_of_roofline"]),
        "offline_vs_hf_generate_batch": target(s["ratio_offline_vs_hf_generate_batch"],
                                               TARGETS["offline_vs_hf_generate_batch"]),
        "startup_s": target(startup, TARGETS["startup_s"], at_least=False),
    }
    if name in TARGETS["batch1_tokens_per_s"]:
        s["targets"]["batch1_tokens_per_s"] = target(b1, TARGETS["batch1_tokens_per_s"][name])
    return s


def notes(args, wl: Workload) -> list[str]:
    return [
        f"weights: random (deepserve load_format=dummy, HF's own init), {dtype_name(args.device)}, same shapes;"
        " prompts are random token ids; no EOS (ignore_eos / min_new_tokens), greedy everywhere",
        f"roofline = {STATED_COPY_BANDWIDTH:.3g} B/s (stated copy bandwidth) / weight_bytes (all parameters, as the "
        "acceptance's targets); *_measured_bw uses the copy bandwidth measured in this run; achieved bandwidths "
        "use decode_read_bytes (without the embedding table of untied shapes)",
        f"deepserve latency: {wl.b1_in} in / {wl.b1_out} out at batch 1, {wl.b32_in}/{wl.b32_out} at batch "
        f"{wl.b32}; decode_ms_per_step averages only steps in which the whole batch decodes",
        f"decode_b64_ctx1k: {wl.ctx_batch} prompts x {wl.ctx_in} tokens, {wl.ctx_out} new; KV bytes per step = "
        "batch x mean context x layers x 2 x kv_heads x head_dim x 2 bytes",
        f"offline: {wl.offline_prompts} prompts x {wl.offline_in} in / {wl.offline_out} out, greedy, both engines",
        f"HF batch-1 decode: {wl.hf_b1_tokens} new tokens; shapes over 8 GB of weights capped at "
        f"{wl.hf_b1_tokens_big} (HF runs ~20-40 tok/s there); tokens/s = (N - 1) / (t(N) - t(1))",
        f"deepserve_eager (enforce_eager=True) runs on the first shape only; gpu_memory_utilization="
        f"{args.gpu_memory_utilization}",
    ] + (["QUICK RUN: shrunken workloads, numbers are not comparable to the targets"] if args.quick else [])


def write_results(args, command: str, results: dict, started: float) -> None:
    from deepserve.bench.throughput import write_json
    wl = QUICK if args.quick else FULL
    machine = results.get("machine", {})
    measured = num(machine, "copy_bandwidth", "measured_Bps")
    shapes = {}
    for name in args.shapes.split(","):
        entry = results.get(name, {})
        elem = elem_bytes(args.device)
        shape = SHAPES[name]
        shapes[name] = {"config": shape, "weight_bytes": weight_bytes(shape, elem),
                        "decode_read_bytes": decode_read_bytes(shape, elem),
                        "kv_bytes_per_token": kv_bytes_per_token(shape, elem), **entry,
                        "summary": summarize(name, entry, measured, elem)}
    payload = {"command": command, "elapsed_s": round(time.time() - started, 1),
               "copy_bandwidth": {"stated_Bps": STATED_COPY_BANDWIDTH, "measured_Bps": measured,
                                  **(machine.get("copy_bandwidth") or {})},
               "workload": dataclasses.asdict(wl), "targets": TARGETS, "notes": notes(args, wl),
               "results": shapes, "machine": machine.get("versions"),
               "machine_phase": {k: v for k, v in machine.items() if k not in ("versions", "copy_bandwidth")}}
    write_json(args.output, payload)


# --- plot ---------------------------------------------------------------------------------------------------

def _bars(ax, names: list[str], series: list[tuple[str, list]], fmt: str = "{:.0f}") -> None:
    width = 0.8 / max(len(series), 1)
    for j, (label, values) in enumerate(series):
        for i, v in enumerate(values):
            if v is None:
                continue
            x = i + (j - (len(series) - 1) / 2) * width
            ax.bar(x, v, width, color=f"C{j}", label=label if label not in ax.get_legend_handles_labels()[1] else None)
            ax.text(x, v, fmt.format(v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(names)), names)


def _hline(ax, i: int, y: float | None, style: str, label: str) -> None:
    if y is not None:
        have = ax.get_legend_handles_labels()[1]
        ax.hlines(y, i - 0.45, i + 0.45, colors="k", linestyles=style, label=None if label in have else label)


def plot(path: str, json_path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as f:
        data = json.load(f)
    res = data["results"]
    names = list(res)

    def col(*keys: str) -> list:
        return [num(res[n], *keys) for n in names]

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax = axes[0][0]
    _bars(ax, names, [("deepserve", col("summary", "deepserve_batch1_tokens_per_s")),
                      ("deepserve eager", col("summary", "eager_batch1_tokens_per_s")),
                      ("HF generate", col("hf_transformers", "generate_b1", "decode_tokens_per_s"))])
    for i, n in enumerate(names):
        roof = num(res[n], "summary", "batch1_roofline_tokens_per_s")
        _hline(ax, i, roof, "solid", "HBM roofline (4.26e12 B/s)")
        _hline(ax, i, roof and roof * TARGETS["batch1_fraction_of_roofline"], "dashed", "target: 70% of roofline")
    ax.set(yscale="log", title="batch-1 decode tokens/s", ylabel="tokens/s")
    ax = axes[0][1]
    _bars(ax, names, [("deepserve offline", col("deepserve", "throughput", "output_tokens_per_s")),
                      ("HF generate_batch", col("hf_transformers", "generate_batch", "output_tokens_per_s")),
                      ("HF generate, batch 32", col("hf_transformers", "generate_b32", "output_tokens_per_s"))])
    for i, n in enumerate(names):
        hf_cb = num(res[n], "hf_transformers", "generate_batch", "output_tokens_per_s")
        _hline(ax, i, hf_cb and hf_cb * TARGETS["offline_vs_hf_generate_batch"], "dashed",
               "target: 20x HF generate_batch")
    ax.set(yscale="log", title="offline output tokens/s (random prompts, greedy)", ylabel="tokens/s")
    ax = axes[1][0]
    tbps = [[v / 1e12 if v else None for v in col("summary", key)]
            for key in ("deepserve_batch1_achieved_Bps", "deepserve_b64_ctx1k_achieved_Bps")]
    _bars(ax, names, [("batch 1", tbps[0]), ("batch 64, 1k context", tbps[1])], "{:.2f}")
    measured = num(data, "copy_bandwidth", "measured_Bps")
    ax.axhline(STATED_COPY_BANDWIDTH / 1e12, color="k", label="copy bandwidth, stated")
    if measured:
        ax.axhline(measured / 1e12, color="k", linestyle=":", label="copy bandwidth, measured")
    ax.set(title="deepserve decode: achieved HBM bandwidth", ylabel="TB/s")
    ax = axes[1][1]
    _bars(ax, names, [("start-up", col("deepserve", "startup", "startup_s")),
                      ("of which graph capture", col("deepserve", "startup", "cuda_graph_capture_s")),
                      ("eager start-up", col("deepserve_eager", "startup", "startup_s"))], "{:.1f}")
    ax.axhline(TARGETS["startup_s"], color="k", linestyle="dashed", label="target < 60 s")
    ax.set(title="deepserve start-up (load + KV profiling + graph capture)", ylabel="seconds")
    for ax in axes.flat:
        ax.legend(fontsize=7)
    machine = data.get("machine") or {}
    fig.suptitle(f"{data['command']}\n{machine.get('gpu', 'no GPU')}, torch {machine.get('torch')}, "
                 f"transformers {machine.get('transformers')}, commit {machine.get('commit')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Description": data["command"]})
    plt.close(fig)


# --- main ---------------------------------------------------------------------------------------------------

def dry_run(args) -> None:
    """Print the plan and check that the configs parse (deepserve's EngineArgs, HF's AutoConfig); no GPU."""
    from deepserve.config import EngineArgs
    wl = QUICK if args.quick else FULL
    print("workload:", json.dumps(dataclasses.asdict(wl)))
    print("phases:", [f"{e}:{s}" if s else e for e, s in plan_phases(args)])
    for name in args.shapes.split(","):
        shape, path = SHAPES[name], write_config(SHAPES[name])
        engine_args = EngineArgs.from_kwargs(model=path, **{**deepserve_kwargs(args), "device": "cpu"})
        config = engine_args.create_engine_config()
        try:
            import transformers
            hf = type(transformers.AutoConfig.from_pretrained(path)).__name__
        except ImportError:
            hf = "transformers not installed"
        wb = weight_bytes(shape)
        kv = wl.ctx_batch * (wl.ctx_in + wl.ctx_out / 2) * kv_bytes_per_token(shape)
        print(f"{name}: weight_bytes={wb / 1e9:.3f} GB decode_read_bytes={decode_read_bytes(shape) / 1e9:.3f} GB "
              f"roofline={STATED_COPY_BANDWIDTH / wb:.0f} tok/s (70%: {0.7 * STATED_COPY_BANDWIDTH / wb:.0f}) "
              f"KV/step at batch {wl.ctx_batch}={kv / 1e9:.2f} GB; deepserve config "
              f"{config.model.architecture} max_model_len={config.model.max_model_len}; HF config {hf}")


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.split("\n")[1:]))
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3-8b", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated subset of " + ", ".join(ENGINES))
    ap.add_argument("--quick", action="store_true", help="shrunken workloads: a smoke test")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test (fp32)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, check the configs, run nothing")
    ap.add_argument("--time-limit", type=float, default=360.0,
                    help="seconds after which measurements not yet started are skipped")
    ap.add_argument("--phase-timeout", type=float, default=300.0, help="kill a phase subprocess after this")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--output", default="benchmarks/h200_dense.json")
    ap.add_argument("--plot", default=None, help="PNG path (default: the output path with .png)")
    # Internal: how the parent starts one phase in a subprocess.
    ap.add_argument("--phase", choices=list(PHASES), help=argparse.SUPPRESS)
    ap.add_argument("--phase-out", help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name in args.shapes.split(","):
        if name not in SHAPES:
            ap.error(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    for engine in args.engines.split(","):
        if engine not in ENGINES:
            ap.error(f"unknown engine {engine!r}; known: {', '.join(ENGINES)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.phase:
        return run_phase(args)
    if args.dry_run:
        return dry_run(args)
    command = "python " + shlex.join(sys.argv if argv is None else [sys.argv[0], *argv])
    started = time.time()
    deadline = started + args.time_limit
    results: dict[str, dict] = {}
    for engine, shape in plan_phases(args):
        data = spawn_phase(args, engine, shape, deadline)
        if shape is None:
            results[engine] = data
        else:
            results.setdefault(shape, {})[engine] = data
        write_results(args, command, results, started)   # after every phase: a later failure keeps the rest
    png = args.plot or os.path.splitext(args.output)[0] + ".png"
    try:
        plot(png, args.output)
    except Exception:
        print("plot failed:", error_tail(1000), flush=True)
    print(f"wrote {args.output} and {png} in {time.time() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
