"""How many greedy tokens quantization="gguf_a8" shares with the fp32 model before the first difference, over several
random-token prompts, with the C decode attention built at 8- and 16-float vectors (the AVX2 / AVX-512 builds; both
run on any x86 CPU with GCC vectors). cpu_vs_llamacpp.py reports this count for one prompt; this spreads it over
--prompts to tell a real numeric change from a near tie that flipped.

Run:  python benchmarks/gguf_a8_greedy_agreement.py [--prompts 10] [--tokens 64] [--lanes 8,16] --output F.json
(one process per width: the kernels are built per process)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def measure(lanes: int, prompts: int, tokens: int) -> list[int]:
    """In this process: the fp32 model's and gguf_a8's greedy tokens, the first index where they differ a prompt."""
    import torch
    from deepserve.kernels.cpu import isa
    isa.vector_width_defines = lambda: (f"ATTN_LANES={lanes}", f"LINEAR_LANES={lanes}")
    from deepserve import LLM, SamplingParams
    from deepserve.bench.throughput import random_prompts
    torch.set_num_threads(2)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    batch = [random_prompts(1, 32, 49152, seed=s)[0] for s in range(prompts)]
    outs = {}
    for mode in ("none", "gguf_a8"):
        llm = LLM(quantization=None if mode == "none" else mode, max_model_len=2048, seed=0)
        outs[mode] = [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]
        del llm
    return [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
            for x, y in zip(outs["none"], outs["gguf_a8"])]


def plot(payload: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    names = list(payload["results"])
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        agree = payload["results"][name]["first_difference_per_prompt"]
        ax.bar([i + k * width for i in range(len(agree))], agree, width, label=name.replace("_", " "))
    ax.set_xlabel("prompt (random token ids, seed)")
    ax.set_ylabel("greedy tokens equal to fp32's")
    ax.set_title("gguf_a8 against the fp32 model, first difference per prompt", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--lanes", default="8,16")
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)     # a child process: one width
    ap.add_argument("--output", default=str(HERE / "gguf_a8_greedy_agreement.json"))
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one, args.prompts, args.tokens)))
        return
    from deepserve.bench.throughput import machine_info, write_json
    results = {}
    for lanes in (int(v) for v in args.lanes.split(",")):
        done = subprocess.run([sys.executable, __file__, "--one", str(lanes), "--prompts", str(args.prompts),
                               "--tokens", str(args.tokens)], capture_output=True, text=True, check=True)
        agree = json.loads(done.stdout.strip().splitlines()[-1])
        results[f"attention_{lanes}_floats"] = {"first_difference_per_prompt": agree,
                                                "mean": round(sum(agree) / len(agree), 2)}
        print(lanes, results[f"attention_{lanes}_floats"], flush=True)
    payload = {"command": "python " + shlex.join(sys.argv),
               "workload": {"prompts": args.prompts, "prompt_len": 32, "greedy_tokens": args.tokens, "batched": True,
                            "threads": 2},
               "results": results, "machine": machine_info(), "load_average_end": round(os.getloadavg()[0], 2)}
    write_json(args.output, payload)
    plot(payload, Path(args.output).with_suffix(".png"))


if __name__ == "__main__":
    main()
