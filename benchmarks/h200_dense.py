"""deepserve vs HF transformers on one GPU, random weights of real shapes (bf16), in one run.

Measures for each shape: batch-1 greedy decode tokens/s (both engines; deepserve also against the HBM
roofline = weight bytes / copy bandwidth), and offline throughput on N random prompts x 128 in / 128 out
(deepserve continuous batching vs HF `generate` at batch 32).

Run (on the GPU machine):  python benchmarks/h200_dense.py --output benchmarks/h200_dense.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
import traceback

import torch

SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         intermediate_size=8192, vocab_size=128256, head_dim=64, tie_word_embeddings=True),
    "llama-3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       intermediate_size=14336, vocab_size=128256, head_dim=128, tie_word_embeddings=False),
}


def write_config(shape: dict) -> str:
    d = tempfile.mkdtemp(prefix="shape-")
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", max_position_embeddings=4096,
               rms_norm_eps=1e-5, rope_theta=500000.0, torch_dtype="bfloat16", hidden_act="silu", **shape)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def weight_bytes(shape: dict) -> int:
    h, i, layers, v = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], shape["vocab_size"]
    hd = shape["head_dim"]
    attn = h * (shape["num_attention_heads"] * hd) * 2 + h * (shape["num_key_value_heads"] * hd) * 2
    per_layer = attn + 3 * h * i
    head = 0 if shape["tie_word_embeddings"] else v * h
    return 2 * (layers * per_layer + v * h + head)   # bf16; the embedding is read once per step as LM head


def deepserve_runs(path: str, num_prompts: int) -> dict:
    from deepserve import LLM
    from deepserve.bench.throughput import run_latency, run_throughput

    t0 = time.perf_counter()
    llm = LLM(path, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096,
              max_num_seqs=256, max_num_batched_tokens=8192)
    startup = time.perf_counter() - t0
    lat = run_latency(llm, batch_size=1, input_len=32, output_len=128)
    tp = run_throughput(llm, num_prompts, 128, 128)
    del llm
    torch.cuda.empty_cache()
    return {"startup_s": round(startup, 2), "latency_b1": lat, "throughput": tp}


def hf_runs(path: str, num_prompts: int) -> dict:
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(100, config.vocab_size, (1, 32), device="cuda")
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=128, min_new_tokens=128, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        b1 = 128 / (time.perf_counter() - t)
        prompts = torch.randint(100, config.vocab_size, (num_prompts, 128), device="cuda")
        t = time.perf_counter()
        for i in range(0, num_prompts, 32):
            model.generate(prompts[i:i + 32], max_new_tokens=128, min_new_tokens=128, do_sample=False,
                           pad_token_id=0)
        torch.cuda.synchronize()
        batch32 = num_prompts * 128 / (time.perf_counter() - t)
    del model
    torch.cuda.empty_cache()
    return {"batch1_decode_tokens_per_s": round(b1, 2), "generate_batch32_output_tokens_per_s": round(batch32, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-3.2-1b")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--copy-bandwidth", type=float, default=4.26e12, help="bytes/s measured on the machine")
    ap.add_argument("--output", default="benchmarks/h200_dense.json")
    args = ap.parse_args()
    results = {}
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        path = write_config(shape)
        entry: dict = {"weight_bytes": weight_bytes(shape)}
        roofline = args.copy_bandwidth / entry["weight_bytes"]
        entry["batch1_roofline_tokens_per_s"] = round(roofline, 1)
        for label, fn in (("deepserve", deepserve_runs), ("hf_transformers", hf_runs)):
            try:
                entry[label] = fn(path, args.num_prompts)
            except Exception:   # one failing peer must not lose the other's numbers
                entry[label] = {"error": traceback.format_exc()[-2000:]}
            print(name, label, entry[label], flush=True)
        ds, hf = entry.get("deepserve", {}), entry.get("hf_transformers", {})
        if "latency_b1" in ds:
            entry["deepserve_batch1_fraction_of_roofline"] = round(
                ds["latency_b1"]["decode_tokens_per_s"] / roofline, 3)
        if "latency_b1" in ds and "batch1_decode_tokens_per_s" in hf:
            entry["ratio_batch1_decode_vs_hf"] = round(
                ds["latency_b1"]["decode_tokens_per_s"] / hf["batch1_decode_tokens_per_s"], 2)
            entry["ratio_offline_vs_hf_generate_batch32"] = round(
                ds["throughput"]["output_tokens_per_s"] / hf["generate_batch32_output_tokens_per_s"], 2)
        results[name] = entry
    from deepserve.bench.throughput import machine_info, write_json
    write_json(args.output, {"command": "python " + shlex.join(sys.argv), "results": results,
                             "notes": "eager decode (no CUDA graphs yet), Triton attention; dummy bf16 weights",
                             "machine": machine_info()})


if __name__ == "__main__":
    main()
