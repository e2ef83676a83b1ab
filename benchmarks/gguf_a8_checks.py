"""The side measurements behind quantization="gguf_a8"'s notes in docs/cpu.md, in one run on the CPU (default model):

- rows: ms of one 3072 x 576 Q4_1 GEMM by activation rows, gguf_a8's kernel on each vector path this CPU runs
  against dequantize + sgemm (where gguf_a8.MANY_ROWS stands); with --baseline-rev, the same for gguf_a8.c as it was
  at that git revision, built beside the current one (a same-run A/B of a kernel change);
- sensitivity: the default model's 30 layers in the one-call decode stack (random residual-stream input, 2 rows),
  relative change of the output when the input moves by 1e-7 (relative), gguf against gguf_a8;
- near_tie: the quick start's chat prompt, the LM head on its last hidden state: the fp32 logits' top two, gguf_a8's
  int8 head's, its distance to its float64 reference and to the fp32 logits; with --llama-cpp-site, llama.cpp's
  top two log-probabilities on the same file;
- memory_read: GB/s of torch.sum over fp32 arrays of 30 / 90 / 400 MB with the benchmark's threads (what the weights
  of a decode step, ~90 MB, can be read at).

Run:  python benchmarks/gguf_a8_checks.py [--baseline-rev 7da1832] [--llama-cpp-site DIR] --output F.json
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepserve import LLM, SamplingParams  # noqa: E402
from deepserve.bench.throughput import machine_info, write_json  # noqa: E402
from deepserve.kernels.cpu import build, gguf_a8, isa  # noqa: E402
from deepserve.kernels.cpu import gguf_linear as gk  # noqa: E402
from deepserve.layers.cpu_decode import build_stack  # noqa: E402
from deepserve.loader.gguf_loader import default_model_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def best_ms(fn, reps: int = 50) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return round(best * 1e3, 4)


def baseline_library(rev: str):
    """gguf_a8.c (and the gguf_linear.c it includes) as at git revision `rev`, built into a temporary folder."""
    folder = Path(tempfile.mkdtemp())
    for name in ("gguf_a8.c", "gguf_linear.c"):
        text = subprocess.run(["git", "show", f"{rev}:deepserve/kernels/cpu/{name}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout
        (folder / name).write_text(text)
    lib = build.load(folder / "gguf_a8.c", {})
    lib.gguf_a8_linear.argtypes = [_INT, _INT, _P, _I64, _I64, _P, _I64, _I64, _P, _I64, _INT, _P]
    return lib


def rows(baseline_rev: str | None) -> dict:
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3072, 18, 20), dtype=torch.uint8, generator=gen)
    blocks[..., 0:4] = torch.tensor([0x1e, 0x1f, 0x9e, 0xa0], dtype=torch.uint8)   # d ~ 0.0074, m ~ -0.0077
    packed = gguf_a8.repack(blocks.reshape(3072, -1).contiguous(), gk.Q4_1, 576)
    paths = [p for p in gguf_a8.ISAS if p != "scalar" and gguf_a8.resolved_isa(p) == p]
    old = baseline_library(baseline_rev) if baseline_rev else None
    out = {}
    for m in (1, 4, 8, 16, 32, 64, 128):
        x = torch.randn(m, 576, generator=gen)
        row = {"dequant_sgemm": best_ms(lambda: gguf_a8.linear(x, packed, gk.Q4_1, 576, many_rows=0), 10)}
        for path in paths:
            row[path] = best_ms(lambda: gguf_a8.linear(x, packed, gk.Q4_1, 576, path, many_rows=1 << 30))
            if old is not None:
                y = torch.empty(m, 3072)
                row[f"{path}@{baseline_rev}"] = best_ms(lambda: old.gguf_a8_linear(
                    gk.Q4_1, gguf_a8.ISAS[path], packed.data_ptr(), 3072, 576, x.data_ptr(), m, 576, y.data_ptr(),
                    3072, torch.get_num_threads(), None))
        out[m] = row
        print("rows", m, row, flush=True)
    return out


def sensitivity() -> dict:
    out = {}
    for quantization in ("gguf", "gguf_a8"):
        llm = LLM(max_model_len=512, seed=0, quantization=quantization)
        llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)            # binds the KV caches
        stack = build_stack(list(llm.engine.runner.model.layers))
        block_size = stack.layers[0].kv_cache.shape[2]
        gen = torch.Generator().manual_seed(0)
        h = torch.randn(2, stack.shape.hidden, generator=gen)
        positions, tables = torch.tensor([5, 9]), torch.tensor([[1, 0], [2, 0]])
        slots = tables[torch.arange(2), positions // block_size] * block_size + positions % block_size
        saved = [w.kv_cache.clone() for w in stack.layers]
        outs = []
        for eps in (0.0, 1e-7):
            x = h * (1 + eps * torch.randn(h.shape, generator=gen))
            outs.append(stack.run(x.clone(), positions, slots, tables, positions + 1).clone())
            for w, s in zip(stack.layers, saved):
                w.kv_cache.copy_(s)
        out[quantization] = float((outs[0] - outs[1]).norm() / outs[0].norm())
        del llm
    print("sensitivity", out, flush=True)
    return out


def near_tie(llama_cpp_site: str | None) -> dict:
    llm = LLM(max_model_len=512, seed=0, quantization="gguf_a8")
    tok = llm.get_tokenizer()
    ids = tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True))
    head, seen = llm.engine.runner.model.lm_head, {}
    forward = head.forward
    head.forward = lambda x: seen.setdefault("x", x.detach().clone()) is None or forward(x)
    try:
        llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    finally:
        del head.forward
    x = seen["x"].float().reshape(-1, head.in_features)[-1:]
    exact = x @ head.dequantized_weight().T
    int8 = gguf_a8.linear(x, head.blocks, head.qtype, head.in_features)
    ref = gguf_a8.linear_ref(x, gguf_a8.unpack_ref(head.blocks, head.qtype, head.in_features), head.qtype,
                             head.in_features)
    top = lambda v: [[int(i), round(float(v[0, i]), 3)] for i in v[0].topk(2).indices]       # noqa: E731
    out = {"prompt_tokens": len(ids), "fp32_top2": top(exact), "int8_top2": top(int8),
           "int8_vs_its_float64_reference_max_abs": float((int8 - ref).abs().max()),
           "int8_vs_fp32_relative": float((int8 - exact).norm() / exact.norm())}
    if llama_cpp_site:
        sys.path.append(llama_cpp_site)
        import llama_cpp
        import numpy as np
        lc = llama_cpp.Llama(model_path=default_model_path(), n_threads=torch.get_num_threads(), n_ctx=512,
                             verbose=False)
        lc.eval(ids)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(lc.ctx, -1), shape=(lc.n_vocab(),))
        lp = torch.log_softmax(torch.from_numpy(logits.copy()), -1)
        out["llama_cpp_top2_logprob"] = [[int(i), round(float(lp[i]), 3)] for i in lp.topk(2).indices]
    print("near_tie", out, flush=True)
    return out


def memory_read() -> dict:
    out = {}
    for mb in (30, 90, 400):
        x = torch.ones(mb * 2 ** 20 // 4)
        out[f"{mb}MB_GBps"] = round(x.numel() * 4 / best_ms(x.sum, 2) / 1e6, 1)
    print("memory_read", out, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--baseline-rev", default=None, help="git revision of gguf_a8.c to time beside the current one")
    ap.add_argument("--llama-cpp-site", default=None, help="site-packages holding llama_cpp (another venv)")
    ap.add_argument("--output", default="gguf_a8_checks.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = {"rows_ms_3072x576_q4_1": rows(args.baseline_rev), "sensitivity_1e-7": sensitivity(),
               "near_tie": near_tie(args.llama_cpp_site), "memory_read": memory_read()}
    write_json(args.output, {"command": "python " + " ".join(sys.argv), "machine": machine_info(),
                             "cpu": isa.host().to_json(), "results": results})


if __name__ == "__main__":
    main()
