"""Where a GGUF model's startup goes on the CPU, before and after the loader's own parser and dequantization, in one
run: the gguf package's reader against loader/gguf_file.GGUFFile, the gguf package's dequantization of every
quantized tensor against the loader's (kernels/cpu/gguf_linear.dequantize_ref), and `LLM(model)` built with and
without PyTorch's random init (the loader's zero fill switched off by wrapping it away). Default model by default.

Run (CPU):  python benchmarks/gguf_startup.py --output benchmarks/gguf_startup.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import gguf  # noqa: E402
import torch  # noqa: E402

from deepserve import LLM  # noqa: E402
from deepserve.kernels.cpu import isa  # noqa: E402
from deepserve.loader import gguf_loader  # noqa: E402
from deepserve.loader.gguf_file import GGUFFile  # noqa: E402
from deepserve.worker import model_loader  # noqa: E402


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return round(time.perf_counter() - start, 3)


def dequantize_all(tensors, ours: bool) -> None:
    for t in tensors:
        if t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            if ours:
                gguf_loader._dequantize_blocks(t.data, t.tensor_type)
            else:
                gguf.quants.dequantize(t.data, t.tensor_type)


def build_llm(model: str, random_init: bool) -> None:
    gguf_loader._open_reader_cached.cache_clear()       # each build parses the file, as a new process does
    saved = model_loader._parameters_left_at_zero
    if random_init:
        model_loader._parameters_left_at_zero = contextlib.nullcontext
    try:
        LLM(model, max_model_len=2048, seed=0)
    finally:
        model_loader._parameters_left_at_zero = saved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=gguf_loader.default_model_path())
    ap.add_argument("--output", default="benchmarks/gguf_startup.json")
    args = ap.parse_args()
    build_llm(args.model, random_init=False)             # warm: imports, the C kernels' build, page cache
    ours_file = GGUFFile(args.model)
    result = {
        "parse_s": {"gguf.GGUFReader": seconds(lambda: gguf.GGUFReader(args.model, "r")),
                    "GGUFFile": seconds(lambda: GGUFFile(args.model))},
        "dequantize_all_s": {"gguf.quants.dequantize": seconds(lambda: dequantize_all(ours_file.tensors, False)),
                             "dequantize_ref": seconds(lambda: dequantize_all(ours_file.tensors, True))},
        "llm_startup_s": {"random_init": seconds(lambda: build_llm(args.model, True)),
                          "zero_fill": seconds(lambda: build_llm(args.model, False))},
    }
    host = isa.host()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout
    out = {"command": "python " + " ".join(sys.argv), "commit": commit.strip(), "model": os.path.basename(args.model),
           "cpu": host.model or platform.machine(),
           "cpu_flags": sorted(f for f in host.flags if f.startswith(("avx", "amx", "fma", "f16c"))),
           "threads": torch.get_num_threads(), "results": result,
           "note": "llm_startup_s is LLM(model) after a warm-up build in the same process (imports and the C "
                   "kernels' build excluded), the GGUF parsed again each time; the GGUF parse before this change was "
                   "the gguf package's reader, its dequantization the gguf package's."}
    print(json.dumps(out["results"], indent=1))
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
