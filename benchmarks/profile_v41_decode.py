"""Where a DeepSeek-V4.1 decode step's device time goes (a diagnostic, not a benchmark of record): the scaled V4.1
shape of benchmarks/h200_v41.py, random bf16 weights, ~1k context.

  graph_replay_ms   the captured graph of a batch size replayed back to back (the forward's pure device time;
                    rows read block 0's keys at position context - 1, write only the scratch slot)
  kernels           per-kernel device time of decode steps replayed from the graphs (torch.profiler), summed per
                    kernel name, per step
  prefill           with --prefill-tokens N: the kernel table of one N-token prompt prefilled in one step (eager,
                    as prefill runs), after a warm-up prompt of the same length

Run (GPU machine):  python benchmarks/profile_v41_decode.py --output profile_v41.json
Prefill only:       python benchmarks/profile_v41_decode.py --batches "" --prefill-tokens 16384 --output p.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import h200_v41  # noqa: E402
import profile_gpu_step  # noqa: E402
from deepserve import LLM, SamplingParams  # noqa: E402


def profile_prefill(tokens: int) -> dict:
    llm = LLM(h200_v41.write_model(), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=tokens + 8, max_num_seqs=4, max_num_batched_tokens=tokens, gpu_memory_utilization=0.85,
              enforce_eager=True)
    warm, timed = ({"prompt_token_ids": torch.randint(3, 129000, (tokens,)).tolist()} for _ in range(2))
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(warm, params, use_tqdm=False)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate(timed, params, use_tqdm=False)
        torch.cuda.synchronize()
    table = profile_gpu_step.kernel_table(prof, 1, top=40)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return table


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--output", default="profile_v41.json")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prefill-tokens", type=int, default=0)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    out = {"command": "python " + " ".join(sys.argv), "shape": h200_v41.SCALED_V41, "results": {}}
    if args.prefill_tokens:
        out["prefill"] = profile_prefill(args.prefill_tokens)
        print(json.dumps(out["prefill"])[:6000], flush=True)
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1)
    if not batches:
        return
    llm = LLM(h200_v41.write_model(), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=args.context + 64, max_num_seqs=max(batches), max_num_batched_tokens=16384,
              gpu_memory_utilization=0.6)
    for b in batches:
        res = out["results"][str(b)] = {}
        res["graph_replay_ms"] = profile_gpu_step.graph_replay_ms(llm, b, args.context + 16, reps=100)
        res["kernels"] = profile_gpu_step.profile_steps(llm, b, 10, input_len=args.context)
        print(json.dumps({b: res})[:6000], flush=True)
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
