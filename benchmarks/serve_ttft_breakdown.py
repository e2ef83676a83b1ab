"""Where a server request's time to first token goes, without HTTP: the engine process client (the server's engine
front, engine/engine_client.py) driven by N concurrent asyncio clients, each sending requests of random prompt
token ids one after another (closed loop), as `deepserve bench serve --max-concurrency N` does over HTTP.

Per request, on one clock (time.monotonic is shared by the processes of a host):
  engine    first_token_time - arrival_time   (the command's way in, waiting for a step, the prompt's steps and the
            one that sampled its first token, until the engine processed that step's outputs)
  delivery  client's first output - first_token_time (the update message, the client's rebuild of the output)
and the client's TTFT (first output with a token: any token counts, text or not) and TPOT. Comparing this TTFT with
`bench serve`'s (first chunk with text) over HTTP separates the engine from the HTTP / SSE / detokenizing path.

Run:  python benchmarks/serve_ttft_breakdown.py --model MODEL [--device cuda] [--concurrency 16 64]
          [--num-prompts 256] [--output benchmarks/serve_ttft_breakdown_h200.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def percentiles(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    if not values:
        return {}
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]     # noqa: E731
    return {"median": round(pick(0.5) * 1e3, 3), "p90": round(pick(0.9) * 1e3, 3), "p99": round(pick(0.99) * 1e3, 3),
            "mean": round(sum(values) / len(values) * 1e3, 3)}


async def run(engine, concurrency: int, num_prompts: int, input_len: int, output_len: int, vocab: int) -> dict:
    from deepserve import SamplingParams
    rng = random.Random(concurrency)
    prompts = [[rng.randrange(10, vocab - 10) for _ in range(input_len)] for _ in range(num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    todo = list(range(num_prompts))
    rows = []

    async def client(worker: int) -> None:
        while todo:
            i = todo.pop()
            sent = time.monotonic()
            first = None
            async for out in engine.generate(f"c{concurrency}-{i}", {"prompt_token_ids": prompts[i]}, params,
                                             arrival_time=sent):
                if first is None and out.outputs[0].token_ids:
                    first = time.monotonic()
                final = out
            m = final.metrics
            rows.append((sent, first, m.first_token_time, m.finished_time, len(final.outputs[0].token_ids)))

    start = time.monotonic()
    await asyncio.gather(*(client(w) for w in range(concurrency)))
    elapsed = time.monotonic() - start
    tokens = sum(r[4] for r in rows)
    return {"concurrency": concurrency, "num_prompts": num_prompts, "elapsed_s": round(elapsed, 3),
            "output_tokens_per_s": round(tokens / elapsed, 1),
            "ttft_ms": percentiles([r[1] - r[0] for r in rows]),
            "engine_ms": percentiles([r[2] - r[0] for r in rows]),
            "delivery_ms": percentiles([r[1] - r[2] for r in rows]),
            "tpot_ms": percentiles([(r[3] - r[2]) / max(r[4] - 1, 1) for r in rows])}


async def main_async(args) -> dict:
    from deepserve.config import EngineArgs
    from deepserve.engine.engine_client import EngineProcessClient
    engine_args = EngineArgs(model=args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
                             max_model_len=args.max_model_len)
    engine = EngineProcessClient(engine_args)
    vocab = engine.engine.vocab_size
    result = {"command": "python " + " ".join(sys.argv), "runs": []}
    try:
        await run(engine, 4, 8, args.input_len, 4, vocab)                    # warm-up
        for c in args.concurrency:
            r = await run(engine, c, args.num_prompts, args.input_len, args.output_len, vocab)
            print(json.dumps(r), flush=True)
            result["runs"].append(r)
    finally:
        await engine.shutdown(drain=False)
    return result


def engine_loop(args) -> dict:
    """The same closed loop on an LLMEngine stepped here (no process, no IPC): every step's wall time, rows, prompt
    tokens and whether it replayed a CUDA graph, and each request's first token in steps and ms."""
    from deepserve import SamplingParams
    from deepserve.config import EngineArgs
    from deepserve.engine.engine import LLMEngine
    engine = LLMEngine.from_engine_args(EngineArgs(model=args.model, device=args.device, dtype=args.dtype,
                                                   load_format=args.load_format, max_model_len=args.max_model_len))
    runner = engine.runner
    graph_steps = []
    if runner.cuda_graphs is not None:
        size_for = runner.cuda_graphs.size_for

        def traced(out):
            key = size_for(out)
            graph_steps.append(key is not None)
            return key
        runner.cuda_graphs.size_for = traced
    vocab, c = engine.vocab_size, args.concurrency[0]
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    sent, first, steps = {}, {}, []
    next_id = 0

    def add() -> None:
        nonlocal next_id
        rid = f"r{next_id}"
        next_id += 1
        engine.add_request(rid, {"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(args.input_len)]},
                           params)
        sent[rid] = (time.monotonic(), len(steps))

    for _ in range(c):
        add()
    while engine.has_unfinished_requests():
        t0 = time.monotonic()
        states = engine.step_states()
        t1 = time.monotonic()
        sched = engine.scheduler
        steps.append({"ms": round((t1 - t0) * 1e3, 3), "running": sched.num_running, "waiting": sched.num_waiting})
        for st in states:
            if st.request_id not in first and any(s.num_output_tokens for s in st.seqs):
                first[st.request_id] = (t1, len(steps))
            if st.finished and next_id < args.num_prompts:
                add()
    for i, g in enumerate(graph_steps[:len(steps)]):
        steps[i]["graph"] = g
    ttft = [first[r][0] - sent[r][0] for r in first]
    ttft_steps = sorted(first[r][1] - sent[r][1] for r in first)
    ms = sorted(s["ms"] for s in steps)
    eager = [s["ms"] for s in steps if s.get("graph") is False]
    graph = [s["ms"] for s in steps if s.get("graph")]
    return {"mode": "engine loop (no process)", "concurrency": c, "num_steps": len(steps),
            "ttft_ms": percentiles(ttft), "ttft_steps_median": ttft_steps[len(ttft_steps) // 2],
            "step_ms_median": ms[len(ms) // 2], "graph_steps": len(graph), "eager_steps": len(eager),
            "graph_step_ms_mean": round(sum(graph) / len(graph), 3) if graph else None,
            "eager_step_ms_mean": round(sum(eager) / len(eager), 3) if eager else None,
            "first_steps": steps[:40], "slowest_steps": sorted(steps, key=lambda s: -s["ms"])[:15]}


def profile_prefill(args) -> dict:
    """One step prefilling --concurrency prompts of --input-len tokens (what a wave of new requests costs), after a
    warm-up: wall time, and the device time of every kernel (torch.profiler), summed per name."""
    import torch
    from deepserve import LLM, SamplingParams
    llm = LLM(args.model, device=args.device, dtype=args.dtype, load_format=args.load_format,
              max_model_len=args.max_model_len)
    rng = random.Random(1)
    vocab, c = llm.engine.vocab_size, args.concurrency[0]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def wave():
        prompts = [{"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(args.input_len)]}
                   for _ in range(c)]
        sync()
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        sync()
        return time.perf_counter() - t0
    for _ in range(3):
        wave()
    wall = min(wave() for _ in range(3))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        wave()
    import cProfile
    import pstats
    profiler = cProfile.Profile()
    profiler.enable()
    wave()
    profiler.disable()
    stats = pstats.Stats(profiler)
    host = sorted(((f"{fn[0].rsplit('/', 2)[-1]}:{fn[1]}({fn[2]})", v[3] * 1e3, v[2] * 1e3, v[1])
                   for fn, v in stats.stats.items()), key=lambda r: -r[1])
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name[:90], [0, 0.0])
            k[0] += 1
            k[1] += e.device_time / 1e3
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    return {"mode": "one prefill wave", "prompts": c, "input_len": args.input_len, "wall_ms": round(wall * 1e3, 3),
            "device_ms": round(sum(v[1] for v in kernels.values()), 3),
            "launches": sum(v[0] for v in kernels.values()),
            "kernels": [{"name": n, "count": v[0], "ms": round(v[1], 3)} for n, v in top[:25]],
            "host_cumulative_ms": [{"fn": f, "cum_ms": round(c, 3), "self_ms": round(t, 3), "calls": n}
                                   for f, c, t, n in host[:60]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--output", default=None)
    ap.add_argument("--profile-prefill", action="store_true", help="kernel table of one prefill wave")
    ap.add_argument("--engine-loop", action="store_true", help="the closed loop on an engine stepped in this process, "
                                                               "with a per-step trace (first --concurrency only)")
    args = ap.parse_args()
    from deepserve.bench.throughput import machine_info
    if args.profile_prefill:
        result = {"command": "python " + " ".join(sys.argv), "runs": [profile_prefill(args)]}
    elif args.engine_loop:
        result = {"command": "python " + " ".join(sys.argv), "runs": [engine_loop(args)]}
    else:
        result = asyncio.run(main_async(args))
    result["machine"] = machine_info()
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
