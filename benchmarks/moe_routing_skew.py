"""How evenly a decode step's tokens spread over the experts, in the decode sweep's own engine (random weights,
random prompts), against the uniform random routing that the MoE kernel benchmarks time (tune_moe_decode.py,
moe_shared_fusion_ab.py: softmax of Gaussian logits, top-k).

Why: the MoE kernel benchmarks time uniform routing, and a step whose experts get uneven loads runs more blocks of
BLOCK_M rows than they do. The engine counts each layer's routed tokens per expert (FusedMoE.expert_load, EPLB's
counters, inside CUDA graphs too): reset, one steady decode step, read. Reported per MoE layer: tokens per expert
(max, mean), the blocks of BLOCK_M rows the aligned mode runs (sum of ceil(count / BLOCK_M)) and the same for
uniform random routing of as many tokens. Session 48 (moe_routing_skew_v2lite_cpu_s48.json): the engine's
random-weight V2-Lite routes as evenly as uniform routing (740 blocks against 736 over 11 MoE layers).

Run (GPU machine): python benchmarks/moe_routing_skew.py --output moe_routing_skew.json
  (--shape tiny-moe --device cpu: a quick check anywhere; --layers 4 --device cpu: the shape's first layers on a
  CPU, routing only: the dummy weights are drawn on each device, so a proxy for the GPU's step)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from h200_decode_sweep import MAX_BATCHED_TOKENS, MOE, prefill_steps, write_shape_config  # noqa: E402
from deepserve import LLM, SamplingParams  # noqa: E402
from deepserve.bench.throughput import random_prompts  # noqa: E402
from deepserve.kernels.fused_moe import pick_config  # noqa: E402


def blocks(counts: torch.Tensor, block_m: int) -> int:
    return int(((counts + block_m - 1) // block_m).sum())


def uniform_counts(tokens: int, experts: int, top_k: int, seed: int) -> torch.Tensor:
    """The kernel benchmarks' routing: top-k of softmaxed Gaussian logits, per token."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randn(tokens, experts, generator=gen).softmax(-1).topk(top_k, dim=-1).indices
    return torch.bincount(ids.flatten(), minlength=experts)


def start_decoding(eng, batch: int, context: int) -> None:
    """`batch` random prompts of `context` tokens, stepped until every sequence decodes (two tokens out), then two
    more steps: the batch in a steady decode, with tokens to spare."""
    params = SamplingParams(temperature=0.0, max_tokens=prefill_steps(batch, context) + 32, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, context, eng.vocab_size, 5)):
        eng.add_request(f"skew-{i}", prompt, params, final_output_only=True)
    seqs = [s for rid in list(eng.requests) for s in eng.requests[rid].seqs]
    while not all(s.num_output_tokens >= 2 for s in seqs):
        eng.step()
    for _ in range(2):
        eng.step()
    if any(s.is_finished for s in seqs):
        raise RuntimeError("a sequence finished before the steady decode step")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="deepseek-v2-lite")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--kv-cache-dtype", default="fp8")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=0, help="the model cut to this many layers (0: all; a CPU run)")
    ap.add_argument("--output", default="moe_routing_skew.json")
    args = ap.parse_args()
    shape = dict(MOE[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {}))
    max_len = args.context + 64 + prefill_steps(args.batch, args.context)
    config = write_shape_config(shape, max_len)
    kw = dict(load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", device=args.device,
              max_model_len=max_len, max_num_seqs=args.batch, max_num_batched_tokens=MAX_BATCHED_TOKENS,
              kv_cache_dtype=args.kv_cache_dtype if args.device == "cuda" else "auto")
    if args.device == "cuda":
        kw["gpu_memory_utilization"] = 0.85
    llm = LLM(config, **kw)
    eng = llm.engine
    start_decoding(eng, args.batch, args.context)
    layers = eng.runner.model.moe_layers()
    for layer in layers:
        layer.reset_expert_load()
    eng.step()                                  # one steady decode step of the whole batch
    counts = torch.stack([layer.expert_load for layer in layers]).cpu()
    experts, top_k = counts.shape[1], int(counts[0].sum()) // args.batch
    block_m = pick_config(args.batch * top_k, experts, 64, 64, torch.device(args.device)).block_m
    rows = []
    for i, c in enumerate(counts):
        u = uniform_counts(args.batch, experts, top_k, i)
        rows.append({"layer": i, "max": int(c.max()), "mean": round(float(c.float().mean()), 2),
                     "touched": int((c > 0).sum()), "blocks": blocks(c, block_m),
                     "uniform_max": int(u.max()), "uniform_blocks": blocks(u, block_m), "counts": c.tolist()})
        print({k: v for k, v in rows[-1].items() if k != "counts"}, flush=True)
    total = {k: sum(r[k] for r in rows) for k in ("blocks", "uniform_blocks")}
    print("blocks over all layers:", total, "block_m", block_m, flush=True)
    out = {"command": "python benchmarks/moe_routing_skew.py " + " ".join(sys.argv[1:]),
           "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "shape": args.shape,
           "num_layers": args.layers or shape["num_hidden_layers"],
           "batch": args.batch, "context": args.context, "block_m": block_m, "total": total, "layers": rows}
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)
    plot(out, os.path.splitext(args.output)[0] + ".png")


def plot(out: dict, path: str) -> None:
    """Per MoE layer: the busiest expert's tokens and the blocks run, in the step and under uniform routing."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = out["layers"]
    x = [r["layer"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(x, [r["max"] for r in rows], "o-", label="decode step")
    a.plot(x, [r["uniform_max"] for r in rows], "s--", label="uniform random routing")
    a.plot(x, [r["mean"] for r in rows], ":", color="gray", label="mean")
    a.set_xlabel("MoE layer"), a.set_ylabel("tokens of the busiest expert"), a.legend()
    b.plot(x, [r["blocks"] for r in rows], "o-", label="decode step")
    b.plot(x, [r["uniform_blocks"] for r in rows], "s--", label="uniform random routing")
    b.set_xlabel("MoE layer"), b.set_ylabel(f"blocks of {out['block_m']} rows"), b.legend()
    fig.suptitle(f"{out['shape']} batch {out['batch']} at {out['context']}: tokens per expert ({out['gpu']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
