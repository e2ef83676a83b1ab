"""DeepSeek-V4 on one GPU, deepserve against HF transformers on the same shape and random weights, in one run.

HF transformers implements DeepSeek-V4 (not V4.1), so this is the same-run peer of benchmarks/h200_v41.py: a V4
config at the same width as its scaled V4.1 shape (H 5120, 64 heads of 512, q rank 1280, 8 output groups of rank
1024, window 128, indexer 32 x 128 top-512, 64 experts of 2304 top-6 + 1 shared), 8 layers (2 HCA, then CSA / HCA
alternating, the release's pattern; rates 4 / 128), the first 3 hash-routed. Both engines get the same bf16
weights (HF's random init, saved unquantized and loaded by deepserve).

Measured per engine: decode step time at batch 1 and 8 (1k-token prompts; HF: `generate` with its cache, the step
time from two runs of different lengths), and one prefill of --prefill tokens.

Run (on the GPU machine):  python benchmarks/h200_v4_vs_hf.py --output benchmarks/h200_v4_vs_hf.json
Smoke test on a CPU:        python benchmarks/h200_v4_vs_hf.py --tiny --device cpu --output /tmp/v4.json
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

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
WIDTH = dict(vocab_size=129280, hidden_size=5120, num_attention_heads=64, head_dim=512, partial_rotary_factor=0.125,
             q_lora_rank=1280, o_lora_rank=1024, o_groups=8, sliding_window=128, index_n_heads=32,
             index_head_dim=128, index_topk=512, n_routed_experts=64, num_experts_per_tok=6,
             moe_intermediate_size=2304, compress_rates={CSA: 4, HCA: 128})
TINY = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, head_dim=64, partial_rotary_factor=0.25,
            q_lora_rank=32, o_lora_rank=16, o_groups=2, sliding_window=16, index_n_heads=4, index_head_dim=32,
            index_topk=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            compress_rates={CSA: 4, HCA: 16})


def v4_config(tiny: bool, layers: int = 8):
    import transformers

    types = [HCA, HCA] + [CSA if i % 2 == 0 else HCA for i in range(layers - 2)]
    return transformers.DeepseekV4Config(
        num_hidden_layers=layers, layer_types=types, mlp_layer_types=["hash_moe"] * 3 + ["moe"] * (layers - 3),
        num_key_value_heads=1, n_shared_experts=1, hc_mult=4, max_position_embeddings=65536,
        num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=1, pad_token_id=2, **(TINY if tiny else WIDTH))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build_checkpoint(config, device: str) -> tuple[str, torch.nn.Module]:
    """HF's model with its random init (bf16, on `device`), and the same weights as a checkpoint deepserve loads."""
    import transformers
    from deepserve.tools.make_tiny_checkpoint import deepseek_v4_released, write_json, write_shards

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.DeepseekV4ForCausalLM(config).to(torch.bfloat16).eval()
    path = tempfile.mkdtemp(prefix="v4-peer-")
    stored, _ = deepseek_v4_released({k: v.cpu() for k, v in model.state_dict().items()}, quantize=False)
    cfg = config.to_dict()
    cfg.update(dtype="bfloat16", architectures=["DeepseekV4ForCausalLM"])
    write_json(os.path.join(path, "config.json"), cfg)
    write_shards(path, stored, 4)
    return path, model


def hf_decode(model, batch: int, context: int, steps: int, device: str) -> dict:
    ids = torch.randint(3, model.config.vocab_size - 1, (batch, context), device=device)

    def run(new: int) -> float:
        sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=2)
        sync(device)
        return time.perf_counter() - start

    run(2)                                                     # warm-up
    short, long = run(1), run(1 + steps)
    per_step = (long - short) / steps
    return {"batch_size": batch, "context": context, "decode_ms_per_step": round(per_step * 1e3, 3),
            "decode_tokens_per_s": round(batch / per_step, 2)}


def hf_prefill(model, tokens: int, device: str) -> dict:
    ids = torch.randint(3, model.config.vocab_size - 1, (1, tokens), device=device)
    with torch.no_grad():
        model(ids[:, : min(tokens, 256)], use_cache=False)     # warm-up
        sync(device)
        start = time.perf_counter()
        model(ids, use_cache=False, logits_to_keep=1)
        sync(device)
    elapsed = time.perf_counter() - start
    return {"tokens": tokens, "seconds": round(elapsed, 3), "tokens_per_s": round(tokens / elapsed, 1)}


def ours(path: str, batches: list[int], context: int, steps: int, prefill: int, device: str) -> dict:
    from deepserve import LLM, SamplingParams
    from deepserve.bench.throughput import run_latency

    llm = LLM(path, skip_tokenizer_init=True, dtype="bfloat16", device=device, max_model_len=max(context, prefill) + 64,
              max_num_seqs=max(batches), max_num_batched_tokens=max(prefill, context * max(batches)),
              gpu_memory_utilization=0.6, enable_prefix_caching=False)
    out = {"decode": [], "prefill": None}
    for b in batches:
        r = run_latency(llm, b, context, steps)
        out["decode"].append({k: r[k] for k in ("batch_size", "decode_ms_per_step", "decode_tokens_per_s",
                                                "decode_steps_timed")})
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prompt = {"prompt_token_ids": torch.randint(3, 500, (prefill,)).tolist()}
    llm.generate(prompt, params, use_tqdm=False)               # warm-up
    sync(device)
    start = time.perf_counter()
    llm.generate(prompt, params, use_tqdm=False)
    sync(device)
    elapsed = time.perf_counter() - start
    out["prefill"] = {"tokens": prefill, "seconds": round(elapsed, 3), "tokens_per_s": round(prefill / elapsed, 1)}
    graphs = llm.engine.runner.cuda_graphs
    out["cuda_graph_replays"] = graphs.num_replays if graphs is not None else None    # None: decode ran eagerly
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", default="benchmarks/h200_v4_vs_hf.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny widths (a CPU smoke test of this script)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=4096)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    config = v4_config(args.tiny)
    result = {"command": "python " + " ".join(sys.argv), "config": config.to_dict(), "torch": torch.__version__}
    path, hf = build_checkpoint(config, args.device)
    try:
        result["hf"] = {"decode": [hf_decode(hf, b, args.context, args.steps, args.device) for b in batches],
                        "prefill": hf_prefill(hf, args.prefill, args.device)}
    except Exception:
        result["hf"] = {"error": traceback.format_exc(limit=3)}
    print(json.dumps(result["hf"]), flush=True)
    del hf
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    try:
        result["deepserve"] = ours(path, batches, args.context, args.steps, args.prefill, args.device)
    except Exception:
        result["deepserve"] = {"error": traceback.format_exc(limit=3)}
    print(json.dumps(result["deepserve"]), flush=True)
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
