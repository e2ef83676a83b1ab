"""DEEPSERVE_CPU_FEW_ROW_LINEAR A/B on the CPU: the default model in float32 (the quick start's mode), its linears of
few rows through kernels/cpu/invariant_linear.c or F.linear (MKL), in the engine, rounds alternating, each setting in
a fresh process (the switch is read at import). Measures batch 1 / 4 / 16 / 32 / 64 decode tokens/s (32-token
prompts, 64 new tokens, EOS ignored; run_latency), the time to the first token of a 16- and a 128-token prompt
(prefix caching off), and whether the greedy tokens of the quick start's chat question match across settings.

`--variable DEEPSERVE_CPU_FUSED_DECODE --settings 0,1` A/Bs another switch the same way (there: the float32 model's
decode steps of up to 16 rows in one C call, kernels/cpu/llama_decode.c's f32_gemv, against layer by layer);
`--quantization int8` runs that mode instead of float32.

Run:  python benchmarks/cpu_few_row_linear_ab.py [--variable NAME] [--settings 0,32] [--rounds 3] [--threads 2] \
          --output F.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BATCHES = (1, 4, 16, 32, 64)
PROMPTS = (16, 128)


def measure(threads: int, quantization: str | None) -> dict:
    """In this process (the switch as the environment set it): the numbers of one round."""
    import torch
    from deepserve import LLM, SamplingParams
    from deepserve.bench.throughput import random_prompts, run_latency
    torch.set_num_threads(threads)
    llm = LLM(max_model_len=2048, seed=0, enable_prefix_caching=False, quantization=quantization)
    row = {f"decode_b{b}": round(run_latency(llm, batch_size=b, input_len=32, output_len=64)["decode_tokens_per_s"],
                                 2) for b in BATCHES}
    first = SamplingParams(temperature=0.0, max_tokens=1)
    for n in PROMPTS:
        prompt = random_prompts(1, n, 49152, seed=n)[0]
        t = time.perf_counter()
        llm.generate(prompt, first, use_tqdm=False)
        row[f"ttft_ms_{n}"] = round(1e3 * (time.perf_counter() - t), 2)
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    row["chat_tokens"] = list(chat[0].outputs[0].token_ids)
    return row


def plot(payload: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    settings = list(payload["median"])
    keys = [f"decode_b{b}" for b in BATCHES]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / len(settings)
    for k, s in enumerate(settings):
        values = [payload["median"][s][key] for key in keys]
        bars = ax.bar([i + k * width for i in range(len(keys))], values, width,
                      label=f"{payload['variable']}={s}")
        for b, v in zip(bars, values):
            ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks([i + width * (len(settings) - 1) / 2 for i in range(len(keys))], [f"batch {b}" for b in BATCHES])
    ax.set_ylabel("decode tokens/s (median of rounds)")
    cpu = payload["machine"]["cpu"]
    mode = payload["workload"].get("quantization") or "float32"
    ax.set_title(f"SmolLM2-135M {mode} on the CPU, {payload['threads']} threads\n{cpu['model']}, "
                 f"{' '.join(cpu['isa_flags'][:4])}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variable", default="DEEPSERVE_CPU_FEW_ROW_LINEAR")
    ap.add_argument("--settings", default="0,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default=None, help="the model's mode (default: none, float32), e.g. int8")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--output", default=str(HERE / "cpu_few_row_linear_ab.json"))
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(measure(args.threads, args.quantization)))
        return
    from deepserve.bench.throughput import machine_info, write_json
    settings = args.settings.split(",")
    rounds: dict[str, list[dict]] = {s: [] for s in settings}
    for _ in range(args.rounds):
        for s in settings:
            env = {**os.environ, args.variable: s}
            command = [sys.executable, __file__, "--worker", "--threads", str(args.threads)]
            if args.quantization:
                command += ["--quantization", args.quantization]
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            rounds[s].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(s, {k: v for k, v in rounds[s][-1].items() if k != "chat_tokens"}, flush=True)
    numeric = [k for k in rounds[settings[0]][0] if k != "chat_tokens"]
    median = {s: {k: round(statistics.median(r[k] for r in rows), 2) for k in numeric} for s, rows in rounds.items()}
    chats = {s: rows[0]["chat_tokens"] for s, rows in rounds.items()}
    payload = {
        "command": "python " + shlex.join(sys.argv),
        "threads": args.threads,
        "variable": args.variable,
        "workload": {"model": "the default (SmolLM2-135M-Instruct GGUF, dequantized: float32)",
                     "quantization": args.quantization,
                     "decode": "run_latency: batch b, 32-token prompts, 64 new tokens, EOS ignored",
                     "ttft": "LLM.generate of one random-token prompt, max_tokens=1, prefix caching off"},
        "median": median,
        "ratio_to_first_setting": {s: {k: round(median[s][k] / median[settings[0]][k], 3) for k in numeric}
                                   for s in settings[1:]},
        "chat_greedy_tokens_equal_across_settings": all(t == chats[settings[0]] for t in chats.values()),
        "rounds": {s: [{k: v for k, v in r.items() if k != "chat_tokens"} for r in rows] for s, rows in rounds.items()},
        "machine": machine_info(),
    }
    write_json(args.output, payload)
    plot(payload, Path(args.output).with_suffix(".png"))
    print(json.dumps(payload["ratio_to_first_setting"]), payload["chat_greedy_tokens_equal_across_settings"])


if __name__ == "__main__":
    main()
