"""Offline benchmarks: throughput (many random prompts at once) and latency (one batch, step by step).

Prompts are random token ids so any config (including `load_format="dummy"`) can be measured;
`ignore_eos` makes every request produce exactly `output_len` tokens.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import subprocess
import time
from typing import Any

import torch

from deepserve.kernels.cpu import isa
from deepserve.llm import LLM
from deepserve.sampling_params import SamplingParams


def random_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    # Stay clear of the first ids, where tokenizers keep their special tokens.
    low = min(100, vocab_size // 2)
    ids = torch.randint(low, vocab_size, (num_prompts, input_len), generator=gen)
    return [{"prompt_token_ids": row.tolist()} for row in ids]


_request_ids = itertools.count()


def _warm_up(llm: LLM, input_len: int, seed: int) -> None:
    """One short request (allocator, kernels) that does not count. Its prompt comes from another seed so that
    it leaves nothing in the prefix cache that the measured prompts could hit."""
    prompt = random_prompts(1, input_len, llm.engine.vocab_size, seed + 7919)
    llm.generate(prompt, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)


def run_throughput(llm: LLM, num_prompts: int, input_len: int, output_len: int, seed: int = 0,
                   temperature: float = 1.0) -> dict[str, Any]:
    prompts = random_prompts(num_prompts, input_len, llm.engine.vocab_size, seed)
    params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True, seed=seed)
    _warm_up(llm, input_len, seed)
    preemptions_before = llm.engine.scheduler.num_preemptions
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    in_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {
        "num_prompts": num_prompts, "input_len": input_len, "output_len": output_len,
        "temperature": temperature,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(num_prompts / elapsed, 3),
        "output_tokens_per_s": round(out_tokens / elapsed, 2),
        "total_tokens_per_s": round((in_tokens + out_tokens) / elapsed, 2),
        # This run's preemptions only: the engine may have served other batches before.
        "num_preemptions": llm.engine.scheduler.num_preemptions - preemptions_before,
    }


def run_latency(llm: LLM, batch_size: int, input_len: int, output_len: int, seed: int = 0) -> dict[str, Any]:
    """Prefill time, then per-step decode time for one batch of greedy requests.

    A step is timed as a decode step only when every request of the batch was already decoding before it and
    none had finished: with chunked prefill, the requests whose prompts are done first decode while the others
    still prefill, and they also finish first; neither kind of step is a decode step of `batch_size` sequences.
    """
    engine = llm.engine
    prompts = random_prompts(batch_size, input_len, engine.vocab_size, seed)
    _warm_up(llm, input_len, seed)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    request_ids = [f"latency-{next(_request_ids)}" for _ in prompts]
    try:
        seqs = []
        for request_id, prompt in zip(request_ids, prompts):
            # Final outputs only: building a RequestOutput per request per step would be timed as decode.
            engine.add_request(request_id, prompt, params, final_output_only=True)
            seqs.extend(engine.requests[request_id].seqs)
        timing = _time_steps(engine, seqs)
    except BaseException:
        engine.abort_request(request_ids)
        raise
    step_times = timing["decode_step_times"]
    per_step = sum(step_times) / max(len(step_times), 1)
    total = timing["total_s"]
    return {
        "batch_size": batch_size, "input_len": input_len, "output_len": output_len,
        "prefill_s": round(timing["first_token_s"] or total, 4),
        "decode_ms_per_step": round(per_step * 1e3, 3),
        "decode_tokens_per_s": round(batch_size / per_step, 2) if step_times else None,
        "decode_steps_timed": len(step_times),
        # Mean tokens per sequence (prompt + generated) at the start of the timed steps: what attention reads.
        "mean_context_len": round(timing["mean_context_len"], 1) if step_times else None,
        "output_tokens_per_s": round(batch_size * output_len / total, 2),
        "total_s": round(total, 3),
    }


def _time_steps(engine, seqs: list) -> dict[str, Any]:
    """Run the engine until it is idle; time each step and tell decode steps of the whole batch apart."""
    start = time.perf_counter()
    step_times, contexts, first_token_s = [], [], None
    while engine.has_unfinished_requests():
        all_decoding = all(s.num_output_tokens >= 1 and not s.is_finished for s in seqs)
        context = sum(s.num_tokens for s in seqs) / len(seqs) if all_decoding else 0
        t0 = time.perf_counter()
        engine.step()
        t1 = time.perf_counter()
        if all_decoding:
            step_times.append(t1 - t0)
            contexts.append(context)
        if first_token_s is None and all(s.num_output_tokens >= 1 for s in seqs):
            first_token_s = t1 - start
    return {"decode_step_times": step_times, "first_token_s": first_token_s,
            "mean_context_len": sum(contexts) / max(len(contexts), 1), "total_s": time.perf_counter() - start}


def machine_info() -> dict[str, Any]:
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cpu": isa.host().to_json()}       # model and ISA flags: CPU numbers differ by instruction set
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
