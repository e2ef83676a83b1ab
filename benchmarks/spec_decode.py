"""Speculative decoding (prompt lookup) on the default model: decode speed with and without drafts, and fixed
against confidence-scheduled verification length, measured in one run.

    python benchmarks/spec_decode.py --device cpu  --out benchmarks/spec_decode.json
    python benchmarks/spec_decode.py --device cuda --out benchmarks/spec_decode_h200.json

Workloads (chat template, greedy unless said):
- copy, batch 1: "repeat and correct this paragraph" (the copy-heavy task prompt lookup is for). The greedy text of
  every mode must equal the text without speculation; decode tok/s = (tokens - 1) / (finish - first token).
- mixed, concurrency c: c requests at once, half copy tasks and half free writing (where drafts are mostly
  rejected). Reported per mode: output tok/s of the whole batch, tokens per decode step (mean accepted length) and
  query rows per decode step (verified length: 1 + drafts verified, averaged over sequences and steps).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

PARAGRAPHS = [
    "The comittee met on tuesday to discus the budjet for next year. Several members argued that the libary "
    "needed more funding, while others beleived the roads should come first. In the end they agreed to meet again.",
    "Photosynthesis is the proccess by wich plants turn sunlight, water and carbon dioxide into sugar and oxygen. "
    "It happens mostly in the leafs, inside small structures called chloroplasts, which contain a green pigment.",
    "Our new app lets you track you're daily steps, you're sleep and how much water you drink. Its free to "
    "download, and the premium version adds personalised coaching, weekly reports and a dark mode for night use.",
    "The train from Paris to Lyon leaves at nine oclock every morning and arives just before eleven. Tickets can be "
    "bought at the station or online, and children under four travel for free if they dont need a seat.",
]
FREE = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Give me five ideas for a birthday party for a ten-year-old who loves space.",
    "Explain to a beginner why the sky is blue, in a friendly tone.",
    "Describe your ideal weekend in the mountains.",
]


def copy_messages(i: int) -> list[dict]:
    text = PARAGRAPHS[i % len(PARAGRAPHS)]
    return [{"role": "user", "content": f"Repeat the following paragraph, correcting its spelling mistakes and "
                                        f"changing nothing else:\n\n{text}"}]


def free_messages(i: int) -> list[dict]:
    return [{"role": "user", "content": FREE[i % len(FREE)]}]


MODES = {
    "off": None,
    "ngram_fixed": {"method": "ngram", "num_speculative_tokens": 5, "verify_length": "fixed"},
    # The gate (spec_decode/gate.py) on: speculation only while it measures faster than overlapped plain decoding.
    "ngram_confidence": {"method": "ngram", "num_speculative_tokens": 5, "verify_length": "confidence"},
    "ngram_confidence_nogate": {"method": "ngram", "num_speculative_tokens": 5, "verify_length": "confidence",
                                "gate": False},
}


def run_batch(llm, conversations, max_tokens: int) -> dict:
    from deepserve import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    before = llm.engine.get_stats()
    t0 = time.perf_counter()
    outs = llm.chat(conversations, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = llm.engine.get_stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    decode_rates = []
    for o in outs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        if n > 1 and m.finished_time > m.first_token_time:
            decode_rates.append((n - 1) / (m.finished_time - m.first_token_time))
    steps = [o.metrics.spec_num_steps for o in outs]
    emitted = [o.metrics.spec_num_steps + o.metrics.spec_num_accepted_tokens for o in outs]
    verified = after.spec_decode_num_verified_tokens - before.spec_decode_num_verified_tokens
    spec_steps = after.spec_decode_num_steps - before.spec_decode_num_steps
    seq_steps = sum(steps)
    return {
        "requests": len(conversations), "output_tokens": tokens, "wall_s": round(wall, 3),
        "output_tok_per_s": round(tokens / wall, 2),
        "decode_tok_per_s_per_request": round(sum(decode_rates) / len(decode_rates), 2) if decode_rates else None,
        "mean_accepted_length": round(sum(emitted) / seq_steps, 3) if seq_steps else None,
        "verified_length": round((after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
                                  + seq_steps) / seq_steps, 3) if seq_steps else None,
        "rows_per_step": round(verified / spec_steps, 2) if spec_steps else None,
        "token_ids": [o.outputs[0].token_ids for o in outs],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="benchmarks/spec_decode.json")
    ap.add_argument("--concurrency", default=None, help="comma list (default: cpu 1,8; cuda 1,8,32,64)")
    ap.add_argument("--copy-tokens", type=int, default=None)
    ap.add_argument("--mixed-tokens", type=int, default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each mixed batch in a row on one engine (the gate keeps what it measured, as a "
                         "server would); the median run by output tok/s is reported")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from deepserve import LLM
    from deepserve.bench.throughput import machine_info
    gpu = args.device.startswith("cuda")
    conc = [int(c) for c in (args.concurrency or ("1,8,32,64" if gpu else "1,8")).split(",")]
    copy_tokens = args.copy_tokens or 256
    mixed_tokens = args.mixed_tokens or (256 if gpu else 96)
    results = {"command": "python " + " ".join(sys.argv), "machine": machine_info(), "modes": MODES,
               "copy_batch1": {}, "mixed": {}}
    for mode, spec in MODES.items():
        llm = LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=2048, max_num_seqs=max(conc),
                  speculative_config=spec)
        llm.chat(copy_messages(0), use_tqdm=False)       # warm-up (kernels, caches)
        llm.reset_prefix_cache()
        copy = run_batch(llm, [copy_messages(1)], copy_tokens)
        results["copy_batch1"][mode] = copy
        for c in conc:
            convs = [copy_messages(i) if i % 2 == 0 else free_messages(i) for i in range(c)]
            runs = []
            for _ in range(args.repeats):
                llm.reset_prefix_cache()
                runs.append(run_batch(llm, convs, mixed_tokens))
            runs.sort(key=lambda r: r["output_tok_per_s"])
            best = runs[len(runs) // 2]
            best["output_tok_per_s_runs"] = [r["output_tok_per_s"] for r in runs]
            gate = llm.engine.spec_gate
            if gate is not None:
                best["gate"] = {"speculating_now": gate.speculating, "switches_so_far": gate.num_switches,
                                "tok_per_s_on": round(gate.rates[True] or 0, 1),
                                "tok_per_s_off": round(gate.rates[False] or 0, 1)}
            results["mixed"].setdefault(str(c), {})[mode] = best
        print(mode, json.dumps({k: v for k, v in copy.items() if k != "token_ids"}), flush=True)
        del llm
    base = results["copy_batch1"]["off"]
    for mode in MODES:
        r = results["copy_batch1"][mode]
        r["identical_to_off"] = r["token_ids"] == base["token_ids"]
        r["decode_speedup_vs_off"] = round(r["decode_tok_per_s_per_request"] / base["decode_tok_per_s_per_request"], 3)
    for c, by_mode in results["mixed"].items():
        off = by_mode["off"]
        for mode, r in by_mode.items():
            r["identical_to_off"] = r["token_ids"] == off["token_ids"]
            r["throughput_vs_off"] = round(r["output_tok_per_s"] / off["output_tok_per_s"], 3)
    for section in (results["copy_batch1"], *results["mixed"].values()):
        for r in section.values():
            r.pop("token_ids")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
        f.write("\n")
    print(json.dumps({"copy_batch1": results["copy_batch1"], "mixed": results["mixed"]}, indent=1))
    plot(results, args.out.replace(".json", ".png"))


def plot(results: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    modes = list(results["copy_batch1"])
    a.bar(modes, [results["copy_batch1"][m]["decode_tok_per_s_per_request"] for m in modes])
    a.set_title("copy task, batch 1: decode tok/s")
    conc = list(results["mixed"])
    for m in modes:
        b.plot(conc, [results["mixed"][c][m]["output_tok_per_s"] for c in conc], marker="o", label=m)
    b.set_title("mixed copy/free workload: output tok/s")
    b.set_xlabel("concurrency")
    b.legend()
    fig.suptitle(results["machine"].get("gpu") or "CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
