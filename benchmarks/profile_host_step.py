"""Where the host's time goes in a big decode step (a diagnostic, not a benchmark of record): a 1-layer, 64-wide
random Llama on the CPU with one torch thread, so the model's own compute is small and what cProfile shows is the
engine's Python per step (scheduling, batch building, output processing) at `--batch` sequences.

Run:  python benchmarks/profile_host_step.py --batch 256 [--top 35]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import h200_dense  # noqa: E402
from deepserve import LLM, SamplingParams  # noqa: E402
from deepserve.bench.throughput import random_prompts  # noqa: E402

SHAPE = dict(h200_dense.SHAPES["tiny"], hidden_size=64, intermediate_size=128, num_attention_heads=2,
             num_key_value_heads=1, head_dim=32, num_hidden_layers=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=35)
    args = ap.parse_args()
    torch.set_num_threads(1)
    llm = LLM(h200_dense.write_config(SHAPE), load_format="dummy", skip_tokenizer_init=True, device="cpu",
              max_model_len=256, max_num_seqs=args.batch, max_num_batched_tokens=16384)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(args.batch, 32, eng.vocab_size, 1)):
        eng.add_request(f"host-{i}", prompt, params, final_output_only=True)
    for _ in range(5):
        eng.step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    print(f"{(time.perf_counter() - t0) / args.steps * 1e3:.2f} ms per step at batch {args.batch} (no profiler)")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        eng.step()
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
