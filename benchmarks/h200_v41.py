"""DeepSeek-V4.1 on one H200: prefill and decode of a V4.1-shaped model scaled to fit one GPU, random bf16 weights.

The shape (SCALED_V41): the full width of the commonly reported V4.1-Flash geometry (deepinfer.md §2.2, marked
unverified there: H 5120, 64 heads of D 512 with R 64, q rank 1280, 8 output groups of rank 1024, window 128,
vocabulary 129280, indexer 32 heads x 128, top-k 512, MoE experts of width 2304, top-6 + 1 shared, 4 mHC streams,
20 Sinkhorn iterations) with fewer layers and experts: 8 layers (1 window, 3 C2, 4 C1: the YOCO split at 4),
kv sources [1, 4], index sources [1, 4, 6], candidate source 4, 64 routed experts instead of 384. No Engram, no
draft layers.

Measured, each wrapped on its own (a failure is its error text in the JSON):
  prefill   one prompt of 4k / 16k / 32k tokens in one step (max_num_batched_tokens = the prompt): tokens/s
            and model FLOPs utilisation against 989 TFLOP/s (H200 dense bf16)
  decode    batch 1 / 8 / 64 / 256 at ~1k context: step time, tokens/s, and the roofline step time (active
            weights the step reads + each sequence's KV reads, at the copy bandwidth measured at the start);
            decode steps replay CUDA graphs, and batches 1 / 8 run again eagerly (enforce_eager) for the same-run
            comparison
  kv_cache  the decode engine's KV pools: bytes per token of each, blocks, tokens of context the cache holds, and
            what the same bytes would hold with every position's window states kept

Run (on the GPU machine):  python benchmarks/h200_v41.py --output benchmarks/h200_v41.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

BANDWIDTH = 4.24e12          # H200 copy bandwidth, bytes/s; main() measures the card's own (an H100: about 3.0)
PEAK_BF16 = 989e12           # H200 dense bf16 FLOP/s
BF16, FP32 = 2, 4

TEXT = dict(
    num_hidden_layers=8, hidden_size=5120, num_attention_heads=64, num_key_value_heads=1, vocab_size=129280,
    max_position_embeddings=65536, rms_norm_eps=1e-6, swiglu_limit=10.0, tie_word_embeddings=False,
    sliding_window=128, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_scaling=dict(type="yarn", original_max_position_embeddings=65536, factor=16.0, beta_fast=32, beta_slow=1),
    q_lora_rank=1280, head_dim=512, qk_rope_head_dim=64, o_lora_rank=1024, o_groups=8,
    hc_mult=4, hc_shifted=True, hc_eps=1e-6, hc_sinkhorn_iters=20,
    compress_ratios=[0, 2, 2, 2, 1, 1, 1, 1], index_topk=512, index_n_heads=32, index_head_dim=128,
    kv_source_layer_ids=[1, 4], index_source_layer_ids=[1, 4, 6], candidate_source_layer_id=4,
    candidate_topk_blocks=64, candidate_block_size=16,
    moe_intermediate_size=2304, n_routed_experts=64, n_shared_experts=1, num_experts_per_tok=6,
    routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", norm_topk_prob=True, topk_method="noaux_tc",
    hidden_act="silu", attention_bias=False, attention_dropout=0.0, num_nextn_predict_layers=0,
)
SCALED_V41 = dict(model_type="deepseek_v41", architectures=["DeepseekV41ForCausalLM"], dtype="bfloat16",
                  bos_token_id=0, eos_token_id=1, pad_token_id=2, text_config=TEXT)


def attention_params(t: dict, ratio: int, kv_source: bool, index_source: bool, index_k_source: bool) -> int:
    H, nH, D, Lq, G, Lo = (t["hidden_size"], t["num_attention_heads"], t["head_dim"], t["q_lora_rank"], t["o_groups"],
                           t["o_lora_rank"])
    n = H * Lq + Lq * nH * D + H * D + nH * D * Lo + G * Lo * H
    if kv_source:
        n += H * D * (2 if ratio == 2 else 1)
    if index_source:
        n += Lq * t["index_n_heads"] * t["index_head_dim"] + H * t["index_n_heads"]
    if index_k_source:
        n += D * t["index_head_dim"]
    return n


def layer_roles(t: dict) -> list[tuple[int, bool, bool, bool]]:
    kv, idx = t["kv_source_layer_ids"], t["index_source_layer_ids"]
    return [(r, l in kv, l in idx, l in kv and r > 0) for l, r in enumerate(t["compress_ratios"])]


def expert_params(t: dict) -> int:
    return 3 * t["hidden_size"] * t["moe_intermediate_size"]


def mhc_params(t: dict) -> int:
    m = t["hc_mult"]
    return 2 * m * (m + 2) * m * t["hidden_size"]          # fn of both sublayers, fp32


def active_weight_bytes(t: dict, batch: int) -> float:
    """Bytes a decode step of `batch` sequences must read: attention, mHC (fp32), routers, the shared expert, the
    distinct routed experts the batch touches (expected, uniform routing), the LM head."""
    E, k = t["n_routed_experts"], t["num_experts_per_tok"]
    touched = E * (1 - (1 - k / E) ** batch)
    total = 0.0
    for ratio, kv, idx, ik in layer_roles(t):
        total += attention_params(t, ratio, kv, idx, ik) * BF16 + mhc_params(t) * FP32
        total += (E * t["hidden_size"] + (touched + t["n_shared_experts"]) * expert_params(t)) * BF16
    return total + t["vocab_size"] * t["hidden_size"] * BF16


def kv_read_bytes(t: dict, context: int) -> float:
    """One sequence's per-step cache reads: window keys every layer, the top-k compressed entries of compressed
    layers, the index keys of index sources (all visible entries are scored)."""
    D, W, Di = t["head_dim"], t["sliding_window"], t["index_head_dim"]
    total = 0.0
    for ratio, kv, idx, ik in layer_roles(t):
        total += min(W, context) * D * BF16
        if ratio:
            total += min(t["index_topk"], context // ratio) * D * BF16
        if idx:
            total += context // ratio * Di * BF16
    return total


def flops_per_token(t: dict, context: int) -> float:
    """2 x active parameters (attention, shared + top-k experts, router, LM head) + attention scores and sums over
    the window and top-k entries, + the indexer over every visible entry (causal prefill: about context / 2)."""
    H, nH, D = t["hidden_size"], t["num_attention_heads"], t["head_dim"]
    f = 0.0
    for ratio, kv, idx, ik in layer_roles(t):
        f += 2 * attention_params(t, ratio, kv, idx, ik)
        f += 2 * (t["num_experts_per_tok"] + t["n_shared_experts"]) * expert_params(t)
        f += 2 * t["n_routed_experts"] * H + 2 * mhc_params(t)
        keys = min(t["sliding_window"], context) + (min(t["index_topk"], context // max(ratio, 1)) if ratio else 0)
        f += 4 * nH * D * keys
        if idx:
            f += 2 * t["index_n_heads"] * t["index_head_dim"] * (context // 2) // ratio
    return f + 2 * t["vocab_size"] * H


def write_model() -> str:
    d = tempfile.mkdtemp(prefix="v41-scaled-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(SCALED_V41, f)
    return d


def prefill(path: str, tokens: int) -> dict:
    from deepserve import LLM, SamplingParams
    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=tokens + 8,
              max_num_seqs=4, max_num_batched_tokens=tokens, gpu_memory_utilization=0.85, enforce_eager=True)
    # Two different prompts: the timed one must not hit the prefix cache the warm-up filled.
    warm, timed = ({"prompt_token_ids": torch.randint(3, 129000, (tokens,)).tolist()} for _ in range(2))
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(warm, params, use_tqdm=False)                           # warm-up (kernel compiles)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = llm.generate(timed, params, use_tqdm=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert out[0].num_cached_tokens == 0, "the timed prompt hit the prefix cache"
    flops = flops_per_token(TEXT, tokens) * tokens
    return {"tokens": tokens, "seconds": round(elapsed, 3), "tokens_per_s": round(tokens / elapsed, 1),
            "mfu": round(flops / elapsed / PEAK_BF16, 4)}


def cache_layout(llm) -> dict:
    """The engine's two KV pools (engine/block_manager.py): compressed entries and index keys on the block table for
    the whole context, per-position states (window keys, compressor states) in the window pool for the last
    `window_reach` positions of each sequence; and how many tokens of context the same bytes would hold if every
    position kept its window states (the layout before the window pool)."""
    runner, bm = llm.engine.runner, llm.engine.block_manager
    bs = runner.block_size
    main, window = runner.kv_bytes_per_block(), runner.window_bytes_per_block()
    reach = runner.model.window_reach()
    total = bm.num_blocks * main + bm.num_window_blocks * window
    return {"block_size": bs, "main_blocks": bm.num_blocks, "window_blocks": bm.num_window_blocks,
            "kv_cache_gib": round(total / 2**30, 2), "main_bytes_per_token": main / bs,
            "window_bytes_per_token": window / bs, "window_reach": reach,
            "window_bytes_per_decoding_sequence": (-(-(reach + 1) // bs) + 1) * window,
            "context_tokens": bm.num_blocks * bs,
            "context_tokens_if_every_position_kept_window_states": int(total // ((main + window) / bs))}


def save(result: dict, path: str) -> None:
    """Written after every measurement, so a run cut short still leaves what it measured."""
    with open(path, "w") as f:
        json.dump(result, f, indent=2)


def decode(path: str, batches: list[int], context: int, steps: int, result: dict, output: str,
           eager: bool = False) -> list[dict]:
    """Decode at each batch size; `eager`: without CUDA graphs (the same-run comparison)."""
    from deepserve import LLM
    from deepserve.bench.throughput import run_latency
    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=context + steps + 8, max_num_seqs=max(batches), max_num_batched_tokens=32768,
              gpu_memory_utilization=0.85, enforce_eager=eager)
    graphs = llm.engine.runner.cuda_graphs
    key = "decode_eager" if eager else "decode"
    if not eager:
        result["cuda_graphs"] = {"captured": graphs is not None,
                                 "capture_seconds": round(graphs.capture_seconds, 2) if graphs else None}
        result["kv_cache"] = cache_layout(llm)
        print(json.dumps(result["kv_cache"]), flush=True)
    out = []
    for b in batches:
        try:
            r = run_latency(llm, b, context, steps)
            if not r["decode_steps_timed"]:
                raise RuntimeError(f"no step decoded all {b} sequences at once: {r}")
            roof = (active_weight_bytes(TEXT, b) + b * kv_read_bytes(TEXT, context)) / BANDWIDTH
            r["roofline_ms_per_step"] = round(roof * 1e3, 3)
            r["fraction_of_roofline"] = round(roof * 1e3 / r["decode_ms_per_step"], 4)
            out.append(r)
        except Exception:
            out.append({"batch_size": b, "error": traceback.format_exc(limit=3)})
        print(json.dumps(out[-1]), flush=True)
        result[key] = out
        save(result, output)
    if graphs is not None:
        result["cuda_graphs"]["replays"] = graphs.num_replays
    del llm, graphs                     # the graph runner holds the model too
    gc.collect()
    torch.cuda.empty_cache()
    return out


def plot(data: dict, path: str) -> None:
    """Decode step time against its roofline per batch size, and prefill tokens/s with MFU, from the JSON."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    dec = [d for d in data["decode"] if "decode_ms_per_step" in d]
    if dec:
        b = [d["batch_size"] for d in dec]
        left.plot(b, [d["decode_ms_per_step"] for d in dec], "o-", label="deepserve step (ms)")
        left.plot(b, [d["roofline_ms_per_step"] for d in dec], "s--", label="roofline: active weights + KV at 4.24 TB/s")
        eager = [d for d in data.get("decode_eager", []) if "decode_ms_per_step" in d]
        if eager:
            left.plot([d["batch_size"] for d in eager], [d["decode_ms_per_step"] for d in eager], "x:",
                      label="deepserve eager (no CUDA graphs)")
        left.set_xscale("log", base=2)
        left.set_yscale("log")
        left.set_xlabel("decode batch (sequences, ~1k context)")
        left.set_ylabel("ms per step")
        left.legend(fontsize=8)
    pre = [p for p in data["prefill"] if "tokens_per_s" in p]
    if pre:
        t = [p["tokens"] for p in pre]
        right.bar([str(x) for x in t], [p["tokens_per_s"] for p in pre])
        for i, p in enumerate(pre):
            right.annotate(f"MFU {100 * p['mfu']:.1f}%", (i, p["tokens_per_s"]), ha="center", va="bottom", fontsize=8)
        right.set_xlabel("prompt tokens in one step")
        right.set_ylabel("prefill tokens/s")
    fig.suptitle("DeepSeek-V4.1 shape scaled to one H200 (8 layers, 64 experts; random bf16 weights)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Description": data["command"]})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", default="benchmarks/h200_v41.json")
    ap.add_argument("--plot-only", action="store_true", help="redraw the PNG beside --output from its JSON")
    ap.add_argument("--prefill", default="4096,16384,32768")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--eager-batches", default="1,8", help="decode batches measured again without CUDA graphs")
    args = ap.parse_args()
    if args.plot_only:
        with open(args.output) as f:
            plot(json.load(f), args.output.removesuffix(".json") + ".png")
        return
    global BANDWIDTH
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from h200_dense import copy_bandwidth
    copy = copy_bandwidth("cuda", 4 << 30)
    BANDWIDTH = copy["measured_Bps"]
    path = write_model()
    result = {"command": "python " + " ".join(sys.argv), "shape": SCALED_V41, "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "bandwidth_bytes_per_s": BANDWIDTH, "copy_bandwidth": copy,
              "peak_bf16_flops": PEAK_BF16, "prefill": [], "decode": []}
    if args.batches:
        result["decode"] = decode(path, [int(b) for b in args.batches.split(",")], args.context, args.steps,
                                  result, args.output)
    if args.eager_batches:
        result["decode_eager"] = decode(path, [int(b) for b in args.eager_batches.split(",")], args.context,
                                        args.steps, result, args.output, eager=True)
    gc.collect()
    torch.cuda.empty_cache()
    for tokens in [int(t) for t in args.prefill.split(",") if t]:
        try:
            result["prefill"].append(prefill(path, tokens))
        except Exception:
            result["prefill"].append({"tokens": tokens, "error": traceback.format_exc(limit=3)})
        print(json.dumps(result["prefill"][-1]), flush=True)
        save(result, args.output)
        gc.collect()
        torch.cuda.empty_cache()
    save(result, args.output)


if __name__ == "__main__":
    main()
