"""What batch-invariant mode costs on the CPU: decode tok/s at batch 1 and 32 and prefill tok/s, default model
(SmolLM2-135M GGUF, fp32), mode off and on in the same process, rounds alternating off / on; medians reported.

Run:  python benchmarks/batch_invariant.py --output benchmarks/batch_invariant.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch

from deepserve import LLM
from deepserve.bench.throughput import machine_info, run_latency, write_json
from deepserve.loader.gguf_loader import default_model_path

# (name, batch size, prompt tokens, output tokens, what is reported)
CASES = [("decode_b1", 1, 128, 32, "decode_tokens_per_s"),
         ("decode_b32", 32, 128, 24, "decode_tokens_per_s"),
         ("prefill_8x256", 8, 256, 1, "prefill_tokens_per_s")]


def measure(llm: LLM, batch: int, input_len: int, output_len: int, seed: int) -> dict:
    result = run_latency(llm, batch, input_len, output_len, seed=seed)
    result["prefill_tokens_per_s"] = round(batch * input_len / result["prefill_s"], 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "batch_invariant.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = default_model_path()
    # One step takes every prompt of a case (4096 tokens): each decode step then has the whole batch.
    engines = {mode: LLM(path, dtype="float32", max_model_len=1024, max_num_batched_tokens=4096, seed=0,
                         skip_tokenizer_init=True, batch_invariant=(mode == "on")) for mode in ("off", "on")}
    samples: dict[str, dict[str, list[float]]] = {name: {"off": [], "on": []} for name, *_ in CASES}
    for r in range(args.rounds):
        for name, batch, input_len, output_len, key in CASES:
            for mode, llm in engines.items():
                samples[name][mode].append(measure(llm, batch, input_len, output_len, seed=r)[key])
                print(name, mode, samples[name][mode][-1], flush=True)
    results = {}
    for name, batch, input_len, output_len, key in CASES:
        off, on = (statistics.median(samples[name][m]) for m in ("off", "on"))
        results[name] = {"batch": batch, "input_len": input_len, "output_len": output_len, "metric": key,
                         "off": off, "on": on, "on_over_off": round(on / off, 3),
                         "samples": samples[name]}
    write_json(args.output, {
        "command": f"python benchmarks/batch_invariant.py --rounds {args.rounds} --threads {args.threads}",
        "model": os.path.basename(path), "dtype": "float32",
        "what": "batch-invariant mode (EngineArgs(batch_invariant=True)) vs the default, same process, rounds "
                "alternating; medians of tokens/s (decode: steps where the whole batch decodes; prefill: batch x "
                "prompt tokens / time to every first token)",
        "machine": machine_info(), "results": results})


if __name__ == "__main__":
    main()
