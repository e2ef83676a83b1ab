"""What batch-invariant mode costs on the CPU: decode tok/s at batch 1 and 32 and prefill tok/s, default model
(SmolLM2-135M GGUF, fp32), mode off and on in the same process, rounds alternating off / on; medians reported.
Also what it buys: the largest |logprob| change of one greedy request (top-5 logprobs of 16 tokens) between alone
and in batches of 2, 8 and 32 random companions, per mode.

Run:  python benchmarks/batch_invariant.py --output benchmarks/batch_invariant.json
GPU:  python benchmarks/batch_invariant.py --device cuda --dtype bfloat16 --output benchmarks/batch_invariant_h200.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch

from deepserve import LLM, SamplingParams
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


def logprob_drift(llm: LLM, seed: int = 0) -> float:
    """max |logprob alone - logprob in a batch| over a greedy request's top-5 logprobs, batches of 2, 8, 32."""
    gen = torch.Generator().manual_seed(seed)
    target = {"prompt_token_ids": torch.randint(100, 40000, (37,), generator=gen).tolist()}
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5, ignore_eos=True)

    def values(out) -> list[float]:
        return [lp.logprob for entry in out.outputs[0].logprobs for lp in entry.values()]

    alone = values(llm.generate(target, params, use_tqdm=False)[0])
    worst = 0.0
    for n in (2, 8, 32):
        lengths = torch.randint(3, 60, (n - 1,), generator=gen).tolist()
        others = [{"prompt_token_ids": torch.randint(100, 40000, (k,), generator=gen).tolist()} for k in lengths]
        other_params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * (n - 1)
        outs = llm.generate(others + [target], other_params + [params], use_tqdm=False)
        worst = max(worst, max(abs(a - b) for a, b in zip(alone, values(outs[-1]))))
    return worst


def plot(payload: dict, path: str) -> None:
    """The mode's tokens/s over the default's per case (1.0: free)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = {k: v for k, v in payload["results"].items() if isinstance(v, dict) and "on_over_off" in v}
    fig, ax = plt.subplots(figsize=(6, 3.6))
    bars = ax.bar(list(cases), [v["on_over_off"] for v in cases.values()], color="#9db4d6")
    for b, v in zip(bars, cases.values()):
        ax.text(b.get_x() + b.get_width() / 2, v["on_over_off"], f"{v['on_over_off']:.2f}\n({v['on']} vs {v['off']})",
                ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("batch-invariant / default tokens/s")
    cpu = payload["machine"].get("cpu", {})
    ax.set_title(f"{payload['model']} {payload['dtype']} on {payload['device']}, "
                 f"{payload['machine'].get('torch_threads')} thread(s)\n{cpu.get('model', '')}: "
                 f"{' '.join(f for f in cpu.get('isa_flags', []) if 'avx' in f or 'amx' in f)}", fontsize=8)
    ax.set_ylim(0, 1.4 * max(v["on_over_off"] for v in cases.values()))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "batch_invariant.json"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--model", default=None, help="default: the default model's GGUF")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or default_model_path()
    # One step takes every prompt of a case (4096 tokens): each decode step then has the whole batch.
    gpu = {"gpu_memory_utilization": 0.4} if args.device.startswith("cuda") else {}
    engines = {mode: LLM(path, dtype=args.dtype, device=args.device, max_model_len=1024, max_num_batched_tokens=4096,
                         seed=0, skip_tokenizer_init=True, batch_invariant=(mode == "on"), **gpu)
               for mode in ("off", "on")}
    samples: dict[str, dict[str, list[float]]] = {name: {"off": [], "on": []} for name, *_ in CASES}
    for r in range(args.rounds):
        for name, batch, input_len, output_len, key in CASES:
            for mode, llm in engines.items():
                samples[name][mode].append(measure(llm, batch, input_len, output_len, seed=r)[key])
                print(name, mode, samples[name][mode][-1], flush=True)
    drift = {mode: logprob_drift(llm) for mode, llm in engines.items()}
    results = {"max_logprob_change_alone_vs_batched": drift}
    for name, batch, input_len, output_len, key in CASES:
        off, on = (statistics.median(samples[name][m]) for m in ("off", "on"))
        results[name] = {"batch": batch, "input_len": input_len, "output_len": output_len, "metric": key,
                         "off": off, "on": on, "on_over_off": round(on / off, 3),
                         "samples": samples[name]}
    payload = {
        "command": "python " + " ".join(sys.argv),
        "model": os.path.basename(path), "dtype": args.dtype, "device": args.device,
        "what": "batch-invariant mode (EngineArgs(batch_invariant=True)) vs the default, same process, rounds "
                "alternating; medians of tokens/s (decode: steps where the whole batch decodes; prefill: batch x "
                "prompt tokens / time to every first token)",
        "machine": machine_info(), "results": results}
    write_json(args.output, payload)
    plot(payload, os.path.splitext(args.output)[0] + ".png")


if __name__ == "__main__":
    main()
