"""The packed Q4_1 GEMV at batch 1 on one CPU core: the engine's fp32-activation inner loop against int8
activations over blocks repacked at load (benchmarks/cpu_q4_gemv_kernels.c says how each works), on the default
model's (SmolLM2-135M) weight shapes. Why: on session 31's AMX Xeon llama.cpp decoded faster than deepserve's gguf
mode (cpu_vs_llamacpp_xeon_amx_s31.json), whose step is mostly these GEMVs at about 14 G weights/s a core; this
prices the lever before it is built into the one-call decode stack (kernels/cpu/llama_decode.c).

Run (a CPU with AVX-512 VNNI and a C compiler):
  python benchmarks/cpu_q4_gemv_kernels.py --output benchmarks/cpu_q4_gemv_kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepserve.bench.throughput import machine_info, write_json  # noqa: E402
from deepserve.kernels.cpu import isa  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
# SmolLM2-135M: q/o (576 x 576), k/v (192 x 576), qkv together (960 x 576), gate/up (3072 x 576), down (576 x 1536),
# and the LM head's shape (49152 x 576; the model's head is Q8_0, so this only prices the shape).
SHAPES = [(576, 576), (960, 576), (3072, 576), (576, 1536), (49152, 576)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output", default=os.path.join(HERE, "cpu_q4_gemv_kernels.json"))
    args = ap.parse_args()
    flags = set(isa.host().flags)
    if not {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= flags:
        raise SystemExit(f"needs AVX-512 F/BW/VL and VNNI; this CPU has {sorted(flags)}")
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "gemv")
        subprocess.run(["cc", "-O2", "-o", exe, os.path.join(HERE, "cpu_q4_gemv_kernels.c"), "-lm"], check=True)
        rows = []
        for n, k in SHAPES:
            out = subprocess.run([exe, str(n), str(k)], capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out))
            print(rows[-1], flush=True)
    write_json(args.output, {"command": "python " + " ".join(sys.argv), "machine": machine_info(), "results": rows})


if __name__ == "__main__":
    main()
