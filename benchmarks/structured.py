"""Structured outputs on the CPU: what the grammar bitmask costs a decode step, and what a grammar costs to compile.

1. Decode step, batch 1 and 32 (default model, greedy, ignore_eos, 32 output tokens): each engine step after the
   prefill is timed, free requests and constrained ones (a regex and a JSON schema) alternating in the same run,
   three rounds each; the median step is reported with its overhead over the free one.
2. The sampler alone on [B, vocab] logits: SamplingMetadata.build (every matcher fills its row) + Sampler, with and
   without grammars: the part of (1) that structured outputs add, without the forward's noise.
3. Compile time per schema kind with a fresh compiler (no cache), and the one-off tokenizer-info build.

Run:  python benchmarks/structured.py --output benchmarks/structured.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch

from deepserve import LLM, SamplingParams
from deepserve.layers.sampler import Sampler, SamplingMetadata, SamplingRow
from deepserve.loader.gguf_loader import default_model_path
from deepserve.structured.compiler import GrammarCompiler
from deepserve.structured.matcher import StructuredMatcher
from deepserve.structured.spec import from_structured_outputs

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string", "format": "email"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string",
                                                                                       "pattern": "^[0-9]{5}$"}},
                "required": ["street", "zip"]}},
    "required": ["name", "age", "address"]}
KINDS = {
    "json_schema": {"json": PERSON},
    "json_schema_small": {"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
    "json_object": {"json_object": True},
    "regex": {"regex": r"[A-Z][a-z]{2,8} [0-9]{1,4}(, [A-Z][a-z]+)*"},
    "ebnf": {"grammar": 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n'
                        'factor ::= [0-9]+ | "(" expr ")"\n'},
    "choice": {"choice": ["positive", "negative", "neutral", "mixed", "unknown"]},
}
STEP_GRAMMARS = {"free": None, "regex": {"regex": "[a-z ]{1,400}"}, "json_schema": {"json": PERSON}}


def cpu_info() -> dict:
    info = {"model": None, "flags": None}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and info["model"] is None:
                info["model"] = value.strip()
            elif key == "flags" and info["flags"] is None:
                info["flags"] = value.split()
    info["logical_cpus"] = os.cpu_count()
    return info


def decode_step_ms(llm: LLM, batch: int, grammar: dict | None, tokens: int = 32) -> float:
    """Median wall time of the engine's decode steps (the prefill step excluded)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, structured_outputs=grammar)
    for i in range(batch):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", "Write a short note about the sea:", params)
    times = []
    first = True
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        if not first:
            times.append(time.perf_counter() - t0)
        first = False
    return statistics.median(times[:-1]) * 1e3     # the last step only reports


def step_overheads(llm: LLM, batches: list[int], rounds: int) -> dict:
    out = {}
    for batch in batches:
        samples: dict[str, list[float]] = {name: [] for name in STEP_GRAMMARS}
        for _ in range(rounds):
            for name, grammar in STEP_GRAMMARS.items():      # alternating: drifts in machine load hit all alike
                samples[name].append(decode_step_ms(llm, batch, grammar))
        free = statistics.median(samples["free"])
        out[f"batch_{batch}"] = {name: {"ms_per_step": round(statistics.median(v), 2),
                                        "overhead_ms": round(statistics.median(v) - free, 2),
                                        "rounds_ms": [round(x, 2) for x in v]} for name, v in samples.items()}
    return out


def sampler_overheads(llm: LLM, batches: list[int], reps: int) -> dict:
    """Sampler-only cost (metadata build incl. bitmask fill, masking, argmax) with and without grammars."""
    compiler, vocab = llm.engine.grammar_compiler, llm.engine.vocab_size
    sampler = Sampler()
    out = {}
    for name, grammar in STEP_GRAMMARS.items():
        compiled = compiler.compile(from_structured_outputs(grammar)) if grammar else None
        for batch in batches:
            logits = torch.randn(batch, vocab)
            rows = [SamplingRow(SamplingParams(temperature=0), 0, 10, [1], [], {2},
                                StructuredMatcher(compiled, vocab) if compiled is not None else None)
                    for _ in range(batch)]
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                sampler(logits, SamplingMetadata.build(rows, vocab, "cpu"))
                times.append(time.perf_counter() - t0)
            out.setdefault(f"batch_{batch}", {})[name] = round(statistics.median(times) * 1e3, 3)
    for batch in batches:
        row = out[f"batch_{batch}"]
        row.update({f"{k}_overhead_ms": round(row[k] - row["free"], 3) for k in STEP_GRAMMARS if k != "free"})
    return out


def compile_times(llm: LLM) -> dict:
    compiler = GrammarCompiler(llm.engine.tokenizer, llm.engine.vocab_size)   # fresh: nothing cached
    t0 = time.perf_counter()
    compiler.prepare()          # the one-off tokenizer info, timed apart from the grammars
    out = {"tokenizer_info_ms": round((time.perf_counter() - t0) * 1e3, 1)}
    for name, so in KINDS.items():
        spec = from_structured_outputs(so)
        t0 = time.perf_counter()
        compiler.check(spec)
        check = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiler.compile(spec)
        out[name] = {"check_ms": round(check * 1e3, 2), "compile_ms": round((time.perf_counter() - t0) * 1e3, 2)}
    t0 = time.perf_counter()
    compiler.compile(from_structured_outputs(KINDS["json_schema"]))
    out["json_schema_cached_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
    compiler.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", default=os.path.join(ROOT, "benchmarks", "structured.json"))
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: the 2 cores of the CI machine are shared; 2 spinning threads lose)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(default_model_path(), max_model_len=1024, seed=0)
    result = {
        "command": "python " + " ".join([os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
        "model": os.path.basename(default_model_path()),
        "cpu": cpu_info(), "python": platform.python_version(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "loadavg_before": os.getloadavg(),
        "compile": compile_times(llm),
        "sampler_ms": sampler_overheads(llm, batches, reps=20),
        "decode_step": step_overheads(llm, batches, args.rounds),
        "loadavg_after": os.getloadavg(),
    }
    with open(args.output, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    summary = {k: v for k, v in result.items() if k not in ("cpu",)}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
