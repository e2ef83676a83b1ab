"""Where a GPU decode step's time goes: a diagnostic beside the benchmarks (not a benchmark of record).

For each shape (random bf16 weights of the real sizes):
  step_ms          engine step time at batch 1 (what `bench latency` reports)
  graph_replay_ms  the captured batch-1 graph replayed back to back (pure device time of the forward)
  kernels          per-kernel device time of one eager decode step (torch.profiler), sorted, summed per name
  offline          256 x 128/128: wall time split into prefill and decode steps, the host's wait for the device,
                   and per-kernel device time of a batch-256 decode step
Graph replay time close to the step time means the device is the limit; a gap means host overhead.

Run (GPU machine):  python benchmarks/profile_gpu_step.py --shapes llama-3.2-1b,deepseek-v2-lite --output p.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import h200_dense  # noqa: E402
import h200_moe  # noqa: E402
from deepserve import LLM, SamplingParams  # noqa: E402
from deepserve.bench.throughput import random_prompts, run_latency  # noqa: E402


def config_dir(name: str) -> str:
    if name in h200_dense.SHAPES:
        return h200_dense.write_config(h200_dense.SHAPES[name])
    return h200_moe.write_config(h200_moe.SHAPES[name])


DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def engine(path: str, **extra) -> LLM:
    kw = dict(load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", device=DEVICE, max_model_len=4096,
              max_num_seqs=256, max_num_batched_tokens=8192)
    if DEVICE == "cuda":
        kw["gpu_memory_utilization"] = 0.5
    kw.update(extra)
    return LLM(path, **kw)


def kernel_table(prof, divide: int, top: int = 25) -> dict:
    """Device time per kernel name (us per step), the largest first, and the total."""
    per_name: dict[str, list] = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) or 0
        if t <= 0 or getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        slot = per_name.setdefault(e.key[:90], [0.0, 0])
        slot[0] += t
        slot[1] += e.count
    rows = sorted(per_name.items(), key=lambda kv: -kv[1][0])
    total = sum(v[0] for _, v in rows) / divide
    return {"total_us_per_step": round(total, 1),
            "kernels_per_step": round(sum(v[1] for _, v in rows) / divide, 1),
            "top": [(k, round(v[0] / divide, 1), round(v[1] / divide, 2)) for k, v in rows[:top]]}


def prefill_steps(eng, batch: int, input_len: int) -> int:
    """About how many steps `batch` prompts of `input_len` tokens take to prefill: the step budget, capped while
    something decodes (the scheduler's max_prefill_tokens_while_decoding), plus one."""
    config = eng.scheduler.config
    budget = min(config.max_num_batched_tokens, config.max_prefill_tokens_while_decoding or 1 << 62)
    return -(-batch * input_len // budget) + 1


def start_decoding(eng, batch: int, input_len: int, max_tokens: int, name: str, seed: int) -> list[str]:
    """`batch` random prompts of `input_len` tokens added to the engine and stepped until every one decodes (two
    output tokens each), then three more steps: the batch in a steady decode, each sequence with at least
    `max_tokens` tokens still to go. The first prompts decode while the later ones prefill, so each request asks
    for `max_tokens` plus the prefill's steps; a sequence that finished all the same is an error (the steps after
    would not run the batch asked for: session 34's batch-256 profiles did, at 1k context). Returns the request
    ids."""
    prompts = random_prompts(batch, input_len, eng.vocab_size, seed)
    # The first sequence decodes through the others' prefill steps, its first two tokens and three more steps.
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens + prefill_steps(eng, batch, input_len) + 8,
                            ignore_eos=True)
    ids = [f"{name}-{batch}-{i}" for i in range(batch)]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, params, final_output_only=True)
    seqs = [s for rid in ids for s in eng.requests[rid].seqs]
    while not all(s.num_output_tokens >= 2 for s in seqs):
        eng.step()
    for _ in range(3):
        eng.step()
    sync()
    finished = sum(s.is_finished for s in seqs)
    if finished:
        raise RuntimeError(f"{finished} of {batch} sequences finished before the batch decoded in full: "
                           "give them more max_tokens")
    return ids


def profile_steps(llm: LLM, batch: int, steps: int, input_len: int = 128) -> dict:
    """Kernel table of `steps` decode steps at `batch` (prefill and warm-up steps outside the profile)."""
    eng = llm.engine
    ids = start_decoding(eng, batch, input_len, steps + 8, "prof", 11)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if DEVICE == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            eng.step()
        sync()
    eng.abort_request(ids)
    while eng.has_unfinished_requests():
        eng.step()
    return kernel_table(prof, steps)


def ready_graph(engine, batch: int):
    """The batch's captured decode graph, replayed once on the inputs the last step left with every cache write sent
    to slot -1 (nowhere), so that more replays time or trace the forward alone; None without one."""
    graphs = engine.runner.cuda_graphs
    if graphs is None or batch not in graphs.sizes:
        return None
    torch.cuda.synchronize()
    graphs.inputs.slots[:batch].fill_(-1)
    g = graphs.graph(batch)
    g.replay()
    torch.cuda.synchronize()
    return g


def graph_timeline(engine, batch: int, reps: int = 3, top: int = 15) -> dict | None:
    """Where a captured decode step's device time goes between kernels: the batch's graph replayed `reps` times on
    the inputs the last step left (cache writes sent to slot -1) under torch.profiler, kernels sorted by start.
    Per replay: span (first start to last end), busy (the union of kernel intervals; a PDL-launched kernel's
    interval includes its wait for its predecessor), idle = span - busy (no kernel on the device: launch latency
    after a kernel that does not trigger its successor early), and the largest idle totals by the pair of kernel
    names around them (the pair of the step's last and first kernels holds the gaps between replays too)."""
    g = ready_graph(engine, batch)
    if g is None:
        return None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
    return idle_breakdown(kernels, reps, top) if kernels else {"error": "no kernel events in the profile"}


def idle_breakdown(kernels: list, reps: int, top: int = 15, sequence: int = 60) -> dict:
    """`graph_timeline`'s arithmetic on (start, end, name) kernel intervals (us) of `reps` replays. Plus `sequence`:
    the first kernels of the last replay in launch order with their durations (with DEEPSERVE_PDL=0 each its own):
    which launch of a layer a kernel name in the totals is; and `by_kernel`: every kernel name's launches and
    microseconds a replay, longest total first (the whole replay, where `sequence` stops at its first kernels).
    `exposed`: what each launch adds to the replay's span, the part of it past every earlier-started kernel's end.
    With PDL a kernel starts early and waits, so its duration overstates its cost; its exposed time is what it
    costs the step (the exposed times and the idle time add up to the span): `sequence_exposed_us` beside
    `sequence`, and `exposed_by_kernel` (microseconds a replay by name, largest first)."""
    kernels = sorted(kernels, key=lambda k: k[0])
    per_replay = len(kernels) // reps
    first = (reps - 1) * per_replay
    last = kernels[first:first + sequence]
    idle = 0.0
    reach, prev = kernels[0][1], kernels[0][2]
    exposed = [reach - kernels[0][0]]
    gaps: dict[str, list] = {}
    for start, end, name in kernels[1:]:
        if start > reach:
            slot = gaps.setdefault(f"{prev[:45]} -> {name[:45]}", [0.0, 0])
            slot[0] += start - reach
            slot[1] += 1
            idle += start - reach
        exposed.append(max(0.0, end - max(start, reach)))
        if end > reach:
            reach, prev = end, name
    busy = sum(exposed)
    span = reach - kernels[0][0]
    exposed_totals: dict[str, float] = {}
    for (_, _, name), us in zip(kernels, exposed):
        exposed_totals[name[:70]] = exposed_totals.get(name[:70], 0.0) + us
    rows = sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top]
    totals: dict[str, list] = {}
    for start, end, name in kernels:
        slot = totals.setdefault(name[:70], [0, 0.0])
        slot[0] += 1
        slot[1] += end - start
    by_kernel = [(name, round(n / reps, 1), round(t / reps, 1))
                 for name, (n, t) in sorted(totals.items(), key=lambda kv: -kv[1][1])]
    return {"reps": reps, "kernels_per_replay": round(len(kernels) / reps, 1),
            "span_us": round(span / reps, 1), "busy_us": round(busy / reps, 1), "idle_us": round(idle / reps, 1),
            "kernel_us_sum": round(sum(e - s for s, e, _ in kernels) / reps, 1),
            "top_idle": [(k, round(v[0] / reps, 1), round(v[1] / reps, 1)) for k, v in rows],
            "sequence": [(name[:70], round(end - start, 1)) for start, end, name in last],
            "sequence_exposed_us": [round(us, 1) for us in exposed[first:first + sequence]],
            "by_kernel": by_kernel,
            "exposed_by_kernel": [(name, round(t / reps, 1))
                                  for name, t in sorted(exposed_totals.items(), key=lambda kv: -kv[1])]}


def graph_replay_ms(llm: LLM, size: int, seq_len: int, reps: int = 200) -> float | None:
    graphs = llm.engine.runner.cuda_graphs
    if DEVICE != "cuda" or graphs is None or size not in graphs.sizes:
        return None
    inp = graphs.inputs
    inp.slots[:size].fill_(-1)
    inp.seq_lens[:size].fill_(seq_len)
    inp.positions[:size].fill_(seq_len - 1)
    inp.block_tables[:size].zero_()
    g = graphs.graph(size)
    for _ in range(5):
        g.replay()
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        g.replay()
    sync()
    return round((time.perf_counter() - t0) / reps * 1e3, 4)


def compiled_kernels() -> int:
    """Entries of Triton's on-disk cache (one per compiled kernel variant): growth during serving = JIT."""
    path = os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache")
    return len(os.listdir(path)) if os.path.isdir(path) else 0


@contextlib.contextmanager
def waits_for_device(runner, waits: list):
    """Within the block, each step's wait for the device's result (the runner's `collect`: the step's ready event)
    is appended to `waits`, in seconds."""
    collect = runner.collect

    def timed_collect(step):
        t0 = time.perf_counter()
        if step.ready is not None:
            step.ready.synchronize()
        waits.append(time.perf_counter() - t0)
        return collect(step)
    runner.collect = timed_collect
    try:
        yield
    finally:
        runner.collect = collect


def offline_breakdown(llm: LLM, n: int = 256, ilen: int = 128, olen: int = 128, seed: int = 3) -> dict:
    eng = llm.engine
    prompts = random_prompts(n, ilen, eng.vocab_size, seed)
    waits = []
    step = eng.step
    kinds: dict[str, list] = {"prefill_or_mixed": [], "decode": []}

    schedule = eng.scheduler.schedule
    last = []

    def recorded_schedule():
        out = schedule()
        last[:] = [out]
        return out

    compiles = []

    def timed_step():
        before = compiled_kernels()
        t0 = time.perf_counter()
        out = step()
        elapsed = time.perf_counter() - t0
        decode = bool(last) and all(s.num_new_tokens == 1 for s in last[0].scheduled)
        kinds["decode" if decode else "prefill_or_mixed"].append(elapsed)
        new = compiled_kernels() - before
        if new:
            compiles.append((len(compiles), new, round(elapsed, 3)))
        return out

    eng.scheduler.schedule = recorded_schedule
    eng.step = timed_step
    try:
        with waits_for_device(eng.runner, waits):
            llm.generate(random_prompts(4, ilen, eng.vocab_size, 99), SamplingParams(max_tokens=4, ignore_eos=True),
                         use_tqdm=False)
            waits.clear()
            kinds["decode"].clear()
            kinds["prefill_or_mixed"].clear()
            t0 = time.perf_counter()
            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=olen, ignore_eos=True), use_tqdm=False)
            wall = time.perf_counter() - t0
    finally:
        eng.step = step
        eng.scheduler.schedule = schedule
    return {"wall_s": round(wall, 3), "output_tok_s": round(n * olen / wall, 1),
            "steps": {k: len(v) for k, v in kinds.items()},
            "step_s_total": {k: round(sum(v), 3) for k, v in kinds.items()},
            "step_ms_median": {k: round(sorted(v)[len(v) // 2] * 1e3, 3) if v else None for k, v in kinds.items()},
            "collect_wait_s": round(sum(waits), 3),
            "steps_that_compiled_kernels": compiles}


def run_shape(name: str, args) -> dict:
    path = config_dir(name)
    res: dict = {}

    def guard(key, fn):
        t0 = time.perf_counter()
        try:
            res[key] = fn()
        except Exception:
            res[key] = "error: " + traceback.format_exc()[-1500:]
        print(f"[{name}] {key} ({time.perf_counter() - t0:.1f}s): {json.dumps(res[key])[:3000]}", flush=True)

    llm = engine(path)
    guard("latency_b1", lambda: run_latency(llm, 1, 128, 128))
    guard("latency_b1_again", lambda: run_latency(llm, 1, 128, 128))
    guard("graph_replay_b1_ms_ctx1", lambda: graph_replay_ms(llm, 1, 1))
    guard("graph_replay_b1_ms_ctx193", lambda: graph_replay_ms(llm, 1, 193))
    guard("graph_kernels_b1", lambda: profile_steps(llm, 1, 20))
    if not args.skip_offline:
        guard("offline", lambda: offline_breakdown(llm))
        guard("offline_again", lambda: offline_breakdown(llm, seed=4))
        guard("graph_replay_b256_ms_ctx193", lambda: graph_replay_ms(llm, 256, 193, reps=50))
    del llm
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    llm = engine(path, enforce_eager=True)
    guard("eager_kernels_b1", lambda: profile_steps(llm, 1, 10))
    if not args.skip_offline:
        guard("eager_kernels_b256", lambda: profile_steps(llm, 256, 5))
    del llm
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-3.2-1b,deepseek-v2-lite")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--output", default="profile_gpu_step.json")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script itself")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    out = {"command": "python " + " ".join(sys.argv), "results": {}}
    for name in args.shapes.split(","):
        out["results"][name] = run_shape(name, args)
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
