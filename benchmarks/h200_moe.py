"""deepserve vs HF transformers on MoE shapes (DeepSeek-V2-Lite: MLA + DeepSeekMoE; Qwen3-MoE: GQA + 128
experts), random bf16 weights of the real shapes, one GPU, one run.

For each shape:
  deepserve   batch-1 greedy decode tokens/s (32-token prompt, 128 out), offline throughput on 256 random
              prompts x 128 in / 128 out (continuous batching), with the Triton MoE and MLA backends
  HF          `generate` at batch 1 (decode capped at --hf-b1-tokens: HF's MoE is slow at batch 1) and at
              batch 32 (128 in / 128 out, --hf-b32-batches batches of 32 prompts)
  roofline    active weight bytes per token (what one batch-1 decode step must read: attention, dense MLP,
              shared experts, top-k routed experts, routers, LM head) and the fraction of
              bandwidth / bytes that each engine's batch-1 decode reaches

Every measurement is wrapped on its own: a failure is recorded as its error text in the JSON and the rest runs.
A time budget (--budget-s) skips what is left once it is spent, so the whole run stays bounded.

Run (on the GPU machine):  python benchmarks/h200_moe.py --output benchmarks/h200_moe.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import sys
import tempfile
import time
import traceback

import torch

# Run as a script from a checkout: the repository root (this file's parent's parent) holds the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
            beta_fast=32.0, beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707)

SHAPES = {
    "deepseek-v2-lite": dict(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=2048, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
        moe_intermediate_size=1408, intermediate_size=10944, first_k_dense_replace=1, moe_layer_freq=1,
        topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
        scoring_func="softmax", vocab_size=102400, max_position_embeddings=163840, rope_parameters=YARN,
        tie_word_embeddings=False, bos_token_id=100000, eos_token_id=100001),
    "qwen3-moe": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        moe_intermediate_size=768, intermediate_size=6144, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, vocab_size=151936, max_position_embeddings=40960,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0), use_sliding_window=False,
        sliding_window=None, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
}

BF16 = 2
FP32 = 4


def write_config(shape: dict) -> str:
    d = tempfile.mkdtemp(prefix="moe-shape-")
    cfg = dict(rms_norm_eps=1e-6, hidden_act="silu", torch_dtype="bfloat16", attention_bias=False, **shape)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def _attention_params(s: dict) -> int:
    h = s["hidden_size"]
    if "kv_lora_rank" in s:       # MLA: q_proj, kv_a (latent + rope key), kv_b (per-head nope key + value), o_proj
        heads, r = s["num_attention_heads"], s["kv_lora_rank"]
        q = h * heads * (s["qk_nope_head_dim"] + s["qk_rope_head_dim"])
        kv_a = h * (r + s["qk_rope_head_dim"])
        kv_b = r * heads * (s["qk_nope_head_dim"] + s["v_head_dim"])
        return q + kv_a + kv_b + heads * s["v_head_dim"] * h
    hd = s["head_dim"]
    qkv = h * (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * hd
    return qkv + s["num_attention_heads"] * hd * h


def active_weight_bytes(s: dict) -> dict:
    """Bytes one batch-1 decode step reads (bf16 weights; DeepSeek's router is fp32 in deepserve, as in HF).
    The embedding contributes one row (ignored); the LM head is read whole."""
    h, layers = s["hidden_size"], s["num_hidden_layers"]
    dense_layers = s.get("first_k_dense_replace", 0)
    moe_layers = layers - dense_layers
    experts = s.get("n_routed_experts") or s["num_experts"]
    inter = s["moe_intermediate_size"]
    attn = layers * _attention_params(s) * BF16
    dense = dense_layers * 3 * h * s["intermediate_size"] * BF16
    routed = moe_layers * s["num_experts_per_tok"] * 3 * h * inter * BF16
    shared = moe_layers * 3 * h * inter * (s.get("n_shared_experts") or 0) * BF16
    router = moe_layers * h * experts * (FP32 if "kv_lora_rank" in s else BF16)
    head = s["vocab_size"] * h * BF16
    total = attn + dense + routed + shared + router + head
    all_experts = moe_layers * experts * 3 * h * inter * BF16
    return {"attention": attn, "dense_mlp": dense, "routed_experts_top_k": routed, "shared_experts": shared,
            "routers": router, "lm_head": head, "total": total,
            "total_weights_bytes": total - routed + all_experts}


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def _guard(entry: dict, key: str, deadline: float, fn) -> None:
    """entry[key] = fn(), or the error text, or a note that the time budget was spent."""
    if time.monotonic() > deadline:
        entry[key] = {"skipped": "time budget spent"}
    else:
        try:
            entry[key] = fn()
        except Exception:   # one failing measurement must not lose the others
            entry[key] = {"error": traceback.format_exc()[-2000:]}
    print(key, entry[key], flush=True)


def _backend_names(model) -> dict:
    return {"moe": sorted({type(m.backend).__name__ for m in model.moe_layers()}),
            "attention": sorted({type(a.backend).__name__ for a in model.attention_layers()})}


def deepserve_runs(path: str, args, deadline: float) -> dict:
    from deepserve import LLM
    from deepserve.bench.throughput import run_latency, run_throughput
    from deepserve.layers.moe_triton import select_moe_and_mla_backends

    entry: dict = {}
    t0 = time.perf_counter()
    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096,
              max_num_seqs=256, max_num_batched_tokens=8192)
    runner = llm.engine.runner
    # A no-op when the model runner already switched the backends; makes this script measure the kernels
    # either way.
    select_moe_and_mla_backends(runner.model, runner.device)
    entry["startup_s"] = round(time.perf_counter() - t0, 2)
    entry["backends"] = _backend_names(runner.model)
    entry["cuda_graphs"] = getattr(runner, "cuda_graphs", None) is not None   # decode replayed from graphs
    _guard(entry, "latency_b1", deadline, lambda: run_latency(llm, batch_size=1, input_len=32, output_len=128))
    _guard(entry, "throughput", deadline, lambda: run_throughput(llm, args.num_prompts, 128, 128))
    return entry      # the engine is freed by the caller's collection, before HF loads its copy


def _hf_model(path: str):
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    # Built on the GPU directly: random init of billions of parameters on the CPU takes minutes.
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval(), config


def _generate_rate(model, ids: torch.Tensor, new_tokens: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    return ids.shape[0] * new_tokens / (time.perf_counter() - t)


def hf_runs(path: str, args, deadline: float) -> dict:
    import transformers

    entry: dict = {"transformers": transformers.__version__}
    t0 = time.perf_counter()
    model, config = _hf_model(path)
    entry["startup_s"] = round(time.perf_counter() - t0, 2)
    entry["experts_implementation"] = str(getattr(config, "_experts_implementation", None))
    with torch.inference_mode():
        ids = torch.randint(100, config.vocab_size, (1, 32), device="cuda")
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)   # warm-up
        _guard(entry, "batch1_decode_tokens_per_s", deadline,
               lambda: round(_generate_rate(model, ids, args.hf_b1_tokens), 2))
        prompts = torch.randint(100, config.vocab_size, (32, 128), device="cuda")

        def batch32() -> float:
            rates = [_generate_rate(model, prompts, 128) for _ in range(args.hf_b32_batches)]
            return round(sum(rates) / len(rates), 1)
        _guard(entry, "generate_batch32_output_tokens_per_s", deadline, batch32)
    return entry


def summarize(entry: dict, bandwidth: float) -> None:
    """Roofline fractions and ratios, from whatever measurements succeeded."""
    roofline = bandwidth / entry["active_weight_bytes_per_token"]["total"]
    entry["batch1_roofline_tokens_per_s"] = round(roofline, 1)
    ds, hf = entry.get("deepserve", {}), entry.get("hf_transformers", {})
    ds_b1 = (ds.get("latency_b1") or {}).get("decode_tokens_per_s")
    hf_b1 = hf.get("batch1_decode_tokens_per_s")
    ds_tp = (ds.get("throughput") or {}).get("output_tokens_per_s")
    hf_tp = hf.get("generate_batch32_output_tokens_per_s")
    if isinstance(ds_b1, (int, float)):
        entry["deepserve_batch1_fraction_of_roofline"] = round(ds_b1 / roofline, 3)
    if isinstance(hf_b1, (int, float)):
        entry["hf_batch1_fraction_of_roofline"] = round(hf_b1 / roofline, 3)
        if isinstance(ds_b1, (int, float)):
            entry["ratio_batch1_decode_vs_hf"] = round(ds_b1 / hf_b1, 2)
    if isinstance(ds_tp, (int, float)) and isinstance(hf_tp, (int, float)):
        entry["ratio_offline_vs_hf_generate_batch32"] = round(ds_tp / hf_tp, 2)


def plot(results: dict, command: str, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    for i, name in enumerate(names):
        e = results[name]
        b1 = [((e.get("deepserve") or {}).get("latency_b1") or {}).get("decode_tokens_per_s"),
              (e.get("hf_transformers") or {}).get("batch1_decode_tokens_per_s"),
              e.get("batch1_roofline_tokens_per_s")]
        tp = [((e.get("deepserve") or {}).get("throughput") or {}).get("output_tokens_per_s"),
              (e.get("hf_transformers") or {}).get("generate_batch32_output_tokens_per_s")]
        for j, (v, label) in enumerate(zip(b1, ("deepserve", "HF generate", "HBM roofline"))):
            if isinstance(v, (int, float)):
                ax1.bar(i + (j - 1) * 0.27, v, 0.27, color=f"C{j}", label=label if i == 0 else None)
                ax1.text(i + (j - 1) * 0.27, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
        for j, (v, label) in enumerate(zip(tp, ("deepserve offline (256 prompts)", "HF generate batch 32"))):
            if isinstance(v, (int, float)):
                ax2.bar(i + (j - 0.5) * 0.35, v, 0.35, color=f"C{j}", label=label if i == 0 else None)
                ax2.text(i + (j - 0.5) * 0.35, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    for ax, title in ((ax1, "batch-1 decode tokens/s"), (ax2, "output tokens/s, 128 in / 128 out")):
        ax.set_xticks(range(len(names)), names)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.suptitle(command, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--hf-b1-tokens", type=int, default=32, help="HF batch-1 decode tokens (HF MoE is slow)")
    ap.add_argument("--hf-b32-batches", type=int, default=1, help="HF generate calls of 32 prompts each")
    ap.add_argument("--copy-bandwidth", type=float, default=4.26e12, help="bytes/s measured on the machine")
    ap.add_argument("--budget-s", type=float, default=330.0, help="skip measurements once this much time passed")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--output", default="benchmarks/h200_moe.json")
    ap.add_argument("--plot", default=None, help="PNG path (default: the output path with .png)")
    args = ap.parse_args()
    command = "python " + shlex.join(sys.argv)
    deadline = time.monotonic() + args.budget_s
    results = {}
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        path = write_config(shape)
        entry: dict = {"active_weight_bytes_per_token": active_weight_bytes(shape)}
        _guard(entry, "deepserve", deadline, lambda p=path: deepserve_runs(p, args, deadline))
        _free()       # the engine (weights, KV cache) must be gone before HF builds its model
        if not args.skip_hf:
            _guard(entry, "hf_transformers", deadline, lambda p=path: hf_runs(p, args, deadline))
            _free()
        summarize(entry, args.copy_bandwidth)
        results[name] = entry
        write_results(args, command, results)      # after every shape: a later crash keeps what was measured
    write_results(args, command, results)
    try:
        plot(results, command, args.plot or os.path.splitext(args.output)[0] + ".png")
    except Exception:
        print("plot failed:", traceback.format_exc()[-1000:], flush=True)


def write_results(args, command: str, results: dict) -> None:
    from deepserve.bench.throughput import machine_info, write_json
    notes = [f"HF batch-1 decode is {args.hf_b1_tokens} new tokens after a 32-token prompt (capped: HF's MoE is "
             "slow at batch 1); deepserve batch-1 decode is 128 tokens after a 32-token prompt",
             f"HF batch 32 is {args.hf_b32_batches} generate call(s) of 32 prompts x 128 in / 128 out; deepserve "
             f"offline is {args.num_prompts} prompts x 128 in / 128 out with continuous batching",
             "dummy bf16 weights (random routing); deepserve decode runs eagerly or from CUDA graphs as each "
             "shape's deepserve.cuda_graphs says; roofline = copy bandwidth / active weight bytes per token"]
    write_json(args.output, {"command": command, "results": results, "notes": notes, "machine": machine_info()})


if __name__ == "__main__":
    main()
