"""MLA's two per-head weight products at decode batch sizes on the GPU: the Triton kernels (`absorb_query` +
`expand_values`, kernels/mla_absorb.py), as GEMVs and as tensor-core GEMMs, against the cuBLAS bmm pair they
replace up to MAX_MMA_BATCH rows, for DeepSeek-V2-Lite's kv_b (16 heads, 128 + 128 rows of 512 a head).

Each setting runs inside a CUDA graph of 20 calls (both products a call, as a layer runs them) that cycle over 16
copies of kv_b (64 MB, more than the L2: a step reads each layer's weights cold). Reported: microseconds per call
(both products) for each batch size: `gemv_us` and `mma_us` (the two Triton kernel families, forced), `cublas_us`,
and `engine` (which one the decode backend uses at that batch).

Run (GPU machine):  python benchmarks/mla_absorb_ab.py --output mla_absorb_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from deepserve.kernels.mla_absorb import (MAX_ABSORB_BATCH, MAX_MMA_BATCH, absorb_query,  # noqa: E402
                                          absorb_query_ref, absorb_supported, expand_values, expand_values_ref,
                                          use_mma)
from tune_gemv import graph_time  # noqa: E402

HEADS, NOPE, V_DIM, RANK = 16, 128, 128, 512
COPIES = 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,2,3,4,8,16,32,64,128,256")
    ap.add_argument("--output", default="mla_absorb_ab.json")
    args = ap.parse_args()
    kv_b = [torch.randn(HEADS, NOPE + V_DIM, RANK, dtype=torch.bfloat16, device="cuda") / 16 for _ in range(COPIES)]
    w_uk = [w[:, :NOPE] for w in kv_b]
    w_uv = [w[:, NOPE:] for w in kv_b]
    out = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
           "engine_max_absorb_batch": MAX_ABSORB_BATCH, "engine_max_mma_batch": MAX_MMA_BATCH, "results": []}
    for bsz in [int(b) for b in args.batches.split(",")]:
        q_nope = torch.randn(bsz, HEADS, NOPE, dtype=torch.bfloat16, device="cuda")
        out_lat = torch.randn(HEADS, bsz, RANK, dtype=torch.bfloat16, device="cuda").transpose(0, 1)
        result = torch.empty(bsz, HEADS, V_DIM, dtype=torch.bfloat16, device="cuda")

        def triton_pair(mma):
            def call(c):
                absorb_query(q_nope, w_uk[c], mma=mma)
                expand_values(out_lat, w_uv[c], result, mma=mma)
            return call

        def cublas_pair(c):
            absorb_query_ref(q_nope, w_uk[c])
            expand_values_ref(out_lat, w_uv[c], result)

        row = {"batch": bsz,
               "engine": ("mma" if use_mma(bsz) else "gemv") if absorb_supported(bsz) else "cublas"}
        for name, fn in (("gemv_us", triton_pair(False)), ("mma_us", triton_pair(True)), ("cublas_us", cublas_pair)):
            if name == "gemv_us" and bsz > 32:      # ~1.6 us a row: not a contender
                continue
            row[name] = round(graph_time(fn, COPIES) * 1e3, 2)
        row["mma_speedup_vs_cublas"] = round(row["cublas_us"] / row["mma_us"], 3)
        out["results"].append(row)
        print(row, flush=True)
    with open(args.output, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
