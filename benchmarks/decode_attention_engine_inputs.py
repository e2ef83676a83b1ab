"""Why a paged decode kernel of 512 programs takes longer inside a decode step than alone: a bisection.

Llama-3-8B batch 64 at 1k context: the kernel took 91-92 us a layer in graph replays of real steps
(h200_step_kernel_sequences.json) against 69-70 us in decode_attention_in_step.py, which rebuilds the step's
surroundings (GEMMs between calls, blocks in runs, the engine's cache sizes: decode_attention_in_step_h200.json).
Here the engine itself runs the batch to a steady decode; then, in the same process, the kernel is timed (each call
between two 235 MB GEMMs, DEEPSERVE_PDL=0, torch profiler) on:
  engine        the engine's own tensors: layer 0's KV cache, the CUDA graph's static block tables and sequence
                lengths (int64 views into one flat buffer), its row indices, inputs_ready as the backend passes it
  int32_inputs  the same values as contiguous int32 tensors
  not_ready     the engine's tensors, inputs_ready=False
and the graph's own timeline (every layer's decode kernel in a replay, mean) for the in-step number of this run.

Run (GPU machine):  DEEPSERVE_PDL=0 python benchmarks/decode_attention_engine_inputs.py --output engine_inputs.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import h200_decode_sweep as sweep  # noqa: E402
import profile_gpu_step  # noqa: E402
from decode_attention_in_step import kernel_us  # noqa: E402
from deepserve import LLM  # noqa: E402
from deepserve.kernels.paged_attention import decode_attention  # noqa: E402


def steady_engine(name: str, batch: int, context: int) -> LLM:
    """An engine of `name`'s shape (random weights) with `batch` sequences decoding at about `context` tokens."""
    config = sweep.h200_dense.write_config(sweep.DENSE[name])
    llm = LLM(config, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", device="cuda",
              max_model_len=context + 128, max_num_seqs=batch, max_num_batched_tokens=sweep.MAX_BATCHED_TOKENS,
              gpu_memory_utilization=0.85)
    profile_gpu_step.start_decoding(llm.engine, batch, context, 64, "bisect", 5)
    return llm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3-8b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--output", default="engine_inputs.json")
    args = ap.parse_args()
    llm = steady_engine(args.shape, args.batch, args.context)
    eng, b = llm.engine, args.batch
    out = {"command": "DEEPSERVE_PDL=" + os.environ.get("DEEPSERVE_PDL", "1") + " python " + " ".join(sys.argv),
           "gpu": torch.cuda.get_device_name(), "shape": args.shape, "batch": b, "context": args.context}
    timeline = profile_gpu_step.graph_timeline(eng, b, reps=2, top=3) or {}
    seq = timeline.get("sequence", [])
    in_step = [us for name, us in seq if name.startswith("_decode_kernel")]
    out["in_step_decode_us"] = round(sum(in_step) / max(1, len(in_step)), 2)
    graphs = eng.runner.cuda_graphs
    inputs = graphs.inputs
    cache = eng.runner.kv_caches[0]
    tables, lens, rows = inputs.block_tables[:b], inputs.seq_lens[:b], inputs.rows[:b]
    d = cache.shape[4]
    heads = sweep.DENSE[args.shape]["num_attention_heads"]
    q = torch.randn(b, heads, d, dtype=cache.dtype, device="cuda")
    o = torch.empty_like(q)
    max_len = int(lens.max())
    out["engine_tensors"] = {"cache_shape": list(cache.shape), "tables": [str(tables.dtype), list(tables.stride())],
                             "seq_lens": [str(lens.dtype), int(lens.min()), max_len],
                             "first_blocks": tables[:2, :4].tolist()}
    weight = torch.randn(28672, 4096, dtype=torch.bfloat16, device="cuda") * 0.01
    x = torch.randn(b, 4096, dtype=torch.bfloat16, device="cuda")
    tables32, lens32, rows32 = tables.to(torch.int32).contiguous(), lens.to(torch.int32), rows.to(torch.int32)
    variants = {
        "engine": (tables, lens, rows, True),
        "int32_inputs": (tables32, lens32, rows32, True),
        "not_ready": (tables, lens, rows, False),
    }
    out["alone_us"] = {}
    for label, (t, ln, r, ready) in variants.items():
        def call(t=t, ln=ln, r=r, ready=ready):
            torch.nn.functional.linear(x, weight)
            decode_attention(q, cache, t, ln, 0.1, out=o, q_rows=r, seq_ids=r, max_seq_len=graphs.max_model_len,
                             inputs_ready=ready)
        out["alone_us"][label] = kernel_us(call)
        print(label, out["alone_us"][label], flush=True)
    print(json.dumps(out), flush=True)
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
