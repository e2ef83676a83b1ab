"""Where the host's time goes in a big decode step (a diagnostic, not a benchmark of record): a 1-layer, 64-wide
random Llama on the CPU with one torch thread, so the model's own compute is small and what cProfile shows is the
engine's Python per step (scheduling, batch building, output processing) at `--batch` sequences.

The step time is printed first, with the part of it spent in the tiny model's own compute (forward, LM head and
the sampler's kernels: what the GPU runs) and the rest, the host-only share; then cProfile's view of the step.

Run:  python benchmarks/profile_host_step.py --batch 256 [--top 35] [--overlap]   (--batch 32,128,256: each)

`--gpu` (a CUDA machine): the same step loop with Llama-3.2-1B's shape (random bf16 weights) and the engine's GPU
defaults (CUDA graphs, overlapped scheduling), against the replay time of the captured decode graph alone: a step
slower than its replay is held back by the host.
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


class ComputeTimer:
    """Wall time spent inside the model's forward, its LM head and the sampler: the tiny model's own compute."""

    def __init__(self, runner) -> None:
        self.seconds = 0.0
        model = runner.model
        model.forward = self.timed(model.forward)
        model.compute_logits = self.timed(model.compute_logits)
        runner.sampler = self.timed(runner.sampler)

    def timed(self, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return call


def replay_ms(eng, batch: int, repeats: int = 50) -> float:
    """Back-to-back replays of the decode graph a batch of `batch` rows uses (the last step's static inputs)."""
    graphs = eng.runner.cuda_graphs
    key = next(k for k in sorted(graphs.graphs) if k[0] >= batch)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        graphs.graphs[key].replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="256", help="sequences per step; several comma-separated (32,128,256) run one "
                                                   "after another on one engine")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--overlap", action="store_true", help="overlapped scheduling, as on a GPU (off on the CPU)")
    ap.add_argument("--gpu", action="store_true", help="Llama-3.2-1B's shape on a CUDA device (see the docstring)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    if args.gpu:
        llm = LLM(h200_dense.write_config(h200_dense.SHAPES["llama-3.2-1b"]), load_format="dummy",
                  skip_tokenizer_init=True, dtype="bfloat16", device="cuda", gpu_memory_utilization=0.5,
                  max_model_len=256, max_num_seqs=max(batches), max_num_batched_tokens=16384)
    else:
        torch.set_num_threads(1)
        llm = LLM(h200_dense.write_config(SHAPE), load_format="dummy", skip_tokenizer_init=True, device="cpu",
                  max_model_len=256, max_num_seqs=max(batches), max_num_batched_tokens=16384,
                  async_scheduling=args.overlap)
    compute = None if args.gpu else ComputeTimer(llm.engine.runner)
    for batch in batches:
        profile_batch(llm.engine, batch, args, compute)


def profile_batch(eng, batch: int, args, compute: ComputeTimer | None) -> None:
    """Decode steps of `batch` sequences: timed, then under cProfile; the sequences are dropped after."""
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    ids = [f"host-{batch}-{i}" for i in range(batch)]
    for request_id, prompt in zip(ids, random_prompts(batch, 32, eng.vocab_size, 1)):
        eng.add_request(request_id, prompt, params, final_output_only=True)
    for _ in range(5):
        eng.step()
    start_compute = compute.seconds if compute is not None else 0.0
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    step_ms = (time.perf_counter() - t0) / args.steps * 1e3
    if compute is not None:
        compute_ms = (compute.seconds - start_compute) / args.steps * 1e3
        print(f"{step_ms:.2f} ms per step at batch {batch} (no profiler): model compute {compute_ms:.2f} ms, "
              f"host-only {step_ms - compute_ms:.2f} ms")
    else:
        print(f"{step_ms:.2f} ms per step at batch {batch} (no profiler): decode graph replay "
              f"{replay_ms(eng, batch):.2f} ms")
    if args.top:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            eng.step()
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)
    eng.abort_request(ids)


if __name__ == "__main__":
    main()
