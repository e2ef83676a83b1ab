"""Offline benchmarks: throughput (many random prompts at once) and latency (one batch, step by step).

Prompts are random token ids so any config (including `load_format="dummy"`) can be measured;
`ignore_eos` makes every request produce exactly `output_len` tokens.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from typing import Any

import torch

from deepserve.llm import LLM
from deepserve.sampling_params import SamplingParams


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    # Stay clear of the first ids, where tokenizers keep their special tokens.
    low = min(100, vocab_size // 2)
    ids = torch.randint(low, vocab_size, (num_prompts, input_len), generator=gen)
    return [{"prompt_token_ids": row.tolist()} for row in ids]


def run_throughput(llm: LLM, num_prompts: int, input_len: int, output_len: int, seed: int = 0,
                   temperature: float = 1.0) -> dict[str, Any]:
    prompts = random_prompts(num_prompts, input_len, llm.engine.vocab_size, seed)
    params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True, seed=seed)
    # Warm-up (allocator, kernels) on a tiny request so it does not count.
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {
        "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(num_prompts / elapsed, 3),
        "output_tokens_per_s": round(out_tokens / elapsed, 2),
        "total_tokens_per_s": round((in_tokens + out_tokens) / elapsed, 2),
        "num_preemptions": llm.engine.scheduler.num_preemptions,
    }


def run_latency(llm: LLM, batch_size: int, input_len: int, output_len: int, seed: int = 0) -> dict[str, Any]:
    """Prefill time, then per-step decode time for one batch of greedy requests."""
    prompts = random_prompts(batch_size, input_len, llm.engine.vocab_size, seed)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    for i, p in enumerate(prompts):
        engine.add_request(f"latency-{i}", p, params)
    start = time.perf_counter()
    step_times, first_token_at = [], None
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        t1 = time.perf_counter()
        if first_token_at is None and all(o.outputs[0].token_ids for o in outs) and len(outs) == batch_size:
            first_token_at = t1 - start
        elif first_token_at is not None:
            step_times.append(t1 - t0)
    total = time.perf_counter() - start
    per_token = sum(step_times) / max(len(step_times), 1)
    return {
        "batch_size": batch_size, "input_len": input_len, "output_len": output_len,
        "prefill_s": round(first_token_at or total, 4),
        "decode_ms_per_step": round(per_token * 1e3, 3),
        "decode_tokens_per_s": round(batch_size / per_token, 2) if step_times else None,
        "total_s": round(total, 3),
    }


def machine_info() -> dict[str, Any]:
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=os.path.dirname(__file__), timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None
    return info


def write_json(path: str, payload: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
