"""KV cache dtypes side by side, in one run: decode speed, accuracy and capacity of kv_cache_dtype auto (the model's
dtype: fp32 on the CPU, bf16 on a GPU), bfloat16, fp8 (E4M3) and fp8_e5m2 on the same weights.

Per dtype, one engine (all alive at once, the same KV byte budget each), timed in alternating rounds so that a
shared machine's drift hits every dtype alike (the best round is reported):
- decode tokens/s (`bench.throughput.run_latency`: whole-batch decode steps only) at each (batch, context) case;
- the mean NLL of a fixed 600-token text (benchmarks/cpu_smollm2.py's source, as cpu_vs_llamacpp.py): the accuracy
  an 8-bit cache costs;
- KV bytes per token and the tokens the budget holds.

Run:  python benchmarks/kv_cache_dtype.py [--device cpu] [--quantization gguf] [--cases 1x256,1x4096,8x2048]
      (the CPU default: the default model's GGUF file with its packed blocks, the fastest CPU mode)
      python benchmarks/kv_cache_dtype.py --device cuda --model DIR [--load-format dummy] [--cases 64x1024,...]
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch

from deepserve import LLM
from deepserve.bench.throughput import machine_info, run_latency, write_json

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_vs_llamacpp import NLL_TEXT, mean_nll  # noqa: E402

DTYPES = ("auto", "bfloat16", "fp8", "fp8_e5m2")


def parse_cases(text: str) -> list[tuple[int, int]]:
    """"1x256,8x2048" -> [(batch 1, context 256), (batch 8, context 2048)]."""
    return [tuple(int(x) for x in case.split("x")) for case in text.split(",")]


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = list(next(iter(results["decode"].values())))
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(results["decode"])
    for i, (dtype, by_case) in enumerate(results["decode"].items()):
        base = results["decode"]["auto"]
        ratios = [by_case[c]["decode_tokens_per_s"] / base[c]["decode_tokens_per_s"] for c in cases]
        ax.bar([j + i * width for j in range(len(cases))], ratios, width,
               label=f"{dtype} (NLL {results['mean_nll_600_tokens'][dtype]:.4f})")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], [f"batch {c}" for c in cases])
    ax.set_ylabel("decode tok/s relative to auto")
    ax.set_title(f"KV cache dtypes, {results['setup']['device']}, {results['setup']['model_name']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the default model (its GGUF file)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--quantization", default=None, help="default: gguf on the CPU, none on a GPU")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--cases", default="1x256,1x4096,8x2048", help="BATCHxCONTEXT,... (context: prompt tokens)")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    ap.add_argument("--output", default="benchmarks/kv_cache_dtype_cpu.json")
    args = ap.parse_args()
    quantization = args.quantization or ("gguf" if args.device == "cpu" and args.model is None else None)
    quantization = None if quantization == "none" else quantization
    cases = parse_cases(args.cases)
    max_len = max(max(ctx for _, ctx in cases) + args.output_len, 600) + 16     # 600: the NLL text
    engines = {}
    for dtype in args.dtypes.split(","):
        engines[dtype] = LLM(args.model, device=args.device, quantization=quantization, kv_cache_dtype=dtype,
                             load_format=args.load_format, max_model_len=max_len, seed=0,
                             kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                             max_num_seqs=max(b for b, _ in cases),
                             # Every prompt of a case in one prefill step: its decode steps then run the whole batch.
                             max_num_batched_tokens=max(b * ctx for b, ctx in cases) + 64)
    results = {"decode": {d: {} for d in engines}, "kv": {}, "mean_nll_600_tokens": {}}
    for dtype, llm in engines.items():
        runner = llm.engine.runner
        results["kv"][dtype] = {"cache_dtype": str(runner.kv_caches[0].dtype).removeprefix("torch."),
                                "bytes_per_token": runner.kv_bytes_per_token(),
                                "tokens_in_budget": llm.engine.block_manager.num_blocks * runner.block_size}
    for r in range(args.rounds):
        for batch, ctx in cases:
            for dtype, llm in engines.items():
                t = run_latency(llm, batch, ctx, args.output_len, seed=r)
                key = f"{batch}x{ctx}"
                best = results["decode"][dtype].get(key)
                if best is None or t["decode_tokens_per_s"] > best["decode_tokens_per_s"]:
                    results["decode"][dtype][key] = t
                print(f"round {r} {dtype:9s} batch {batch} context {ctx}: {t['decode_tokens_per_s']} tok/s",
                      flush=True)
    first = next(iter(engines.values()))
    nll_ids = None if first.engine.tokenizer is None else first.get_tokenizer().encode(NLL_TEXT.read_text())[:600]
    for dtype, llm in engines.items():
        if nll_ids is not None:
            results["mean_nll_600_tokens"][dtype] = round(mean_nll(llm, nll_ids), 4)
    base = results["decode"].get("auto", {})
    results["decode_ratio_to_auto"] = {d: {c: round(v["decode_tokens_per_s"] / base[c]["decode_tokens_per_s"], 3)
                                           for c, v in by_case.items()} for d, by_case in results["decode"].items()
                                       if base}
    results["setup"] = {"command": "python " + " ".join(shlex.quote(a) for a in sys.argv), "device": args.device,
                        "model_name": Path(first.engine.config.model.model).name, "quantization": quantization,
                        "rounds": args.rounds, "output_len": args.output_len,
                        "date": time.strftime("%Y-%m-%d"), **machine_info()}
    write_json(args.output, results)
    if results["mean_nll_600_tokens"] and "auto" in engines:
        plot(results, str(Path(args.output).with_suffix(".png")))
    print({d: results["decode_ratio_to_auto"].get(d) for d in engines}, results["mean_nll_600_tokens"])


if __name__ == "__main__":
    torch.set_num_threads(torch.get_num_threads())
    main()
