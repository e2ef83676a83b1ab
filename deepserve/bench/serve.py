"""`deepserve bench serve`: load a running OpenAI-compatible server and measure it as its users would.

Requests arrive as a Poisson process of `--request-rate` per second (`inf`: all at once), at most
`--max-concurrency` in flight (several values: one run each), each streaming (SSE) from /v1/completions
(or /v1/chat/completions) with `max_tokens = --output-len` and `ignore_eos`, so every server does the same
work. Per request: TTFT (first text chunk), ITL (gaps between text chunks), TPOT ((E2E - TTFT) / (output
tokens - 1)) and E2E; token counts come from the server's final usage chunk. Reported: request / output /
total-token throughput, mean / median / p90 / p99 of each latency, and goodput (requests per second that met
every SLO given with `--goodput`). Written as JSON, plus a PNG plot when matplotlib is installed.

Prompts are `--input-len` random common English words (about one token each for BPE vocabularies; the
usage chunk gives the exact count), or the first human turn of each ShareGPT conversation (`--dataset`), or
a shared-prefix workload (`--shared-prefix-groups G`): G system prompts of `--shared-prefix-len` random words,
each request one of them (in turn, shuffled) plus its own `--input-len` word question, as many users of a few
applications send (on chat the prefix is the system message, on completions it starts the prompt). The
usage chunk's `prompt_tokens_details.cached_tokens` gives the prefix-cache hit rate the server reports.
Only the server named by `--base-url` is contacted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import httpx

_WORDS = ["time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world", "school", "state", "family", "student", "group", "country", "problem", "hand", "part", "place", "case", "week", "company", "system", "program", "question", "work", "government", "number", "night", "point", "home", "water", "room", "mother", "area", "money", "story", "fact", "month", "lot", "right", "study", "book", "eye", "job", "word", "business", "issue", "side", "kind", "head", "house", "service", "friend", "father", "power", "hour", "game", "line", "end", "member", "law", "car", "city", "community", "name", "president", "team", "minute", "idea", "kid", "body", "information", "back", "parent", "face", "others", "level", "office", "door", "health", "person", "art", "war", "history", "party", "result", "change", "morning", "reason", "research", "girl", "guy", "moment", "air", "teacher", "force", "education", "good", "new", "first", "last", "long", "great", "little", "own", "other", "old", "right", "big", "high", "different", "small", "large", "next", "early", "young", "important", "few", "public", "bad", "same", "able", "make", "know", "take", "see", "come", "think", "look", "want", "give", "use", "find", "tell", "ask", "seem", "feel", "try", "leave", "call", "keep", "let", "begin", "show", "hear", "play", "run", "move", "like", "live", "believe", "hold", "bring", "happen", "write", "provide", "sit", "stand", "lose", "pay", "meet", "include", "continue", "set", "learn", "lead", "understand", "watch", "follow", "stop", "create", "speak", "read", "allow", "add", "spend", "grow", "open", "walk", "win", "offer", "remember", "love", "consider", "appear", "buy", "wait", "serve", "die", "send", "expect"]

_PERCENTILES = (("median", 50), ("p90", 90), ("p99", 99))


@dataclass(frozen=True)
class Prompt:
    text: str
    system: str = ""            # the shared prefix (shared-prefix workload); empty otherwise


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0      # prompt tokens the server took from its prefix cache (0 if it does not say)
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


# --- arguments ------------------------------------------------------------------------------------

def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the first model the server lists")
    parser.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (Poisson); inf = all at once")
    parser.add_argument("--max-concurrency", type=int, nargs="+", default=[0],
                        help="requests in flight at most (0 = no limit); several values: one run each")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--dataset", default=None, help="ShareGPT JSON file (first human turn = prompt)")
    parser.add_argument("--shared-prefix-groups", type=int, default=0, metavar="G",
                        help="shared-prefix workload: G system prompts, each request one of them + its own question")
    parser.add_argument("--shared-prefix-len", type=int, default=256, metavar="WORDS",
                        help="words of each shared system prompt (with --shared-prefix-groups)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--goodput", nargs="*", default=[], metavar="METRIC:MS",
                        help="SLOs for goodput, e.g. ttft:500 tpot:100 e2e:5000 (milliseconds)")
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="let requests stop at EOS (default: always generate --output-len tokens)")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--client-processes", type=int, default=1, metavar="N",
                        help="send from N client processes, each with its share of the prompts, the concurrency and "
                             "the rate, started together; results merged (one Python client saturates near 10k "
                             "streamed tokens/s: benchmarks/serve_client_bound_h200.json)")
    parser.add_argument("--label", default=None, help="name of the server in the JSON and the plot")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--plot", default=None, help="PNG path (default: --output-json with .png)")
    parser.add_argument("--compare", nargs="*", default=[], help="earlier result JSON files to plot alongside")


def run_from_args(args: argparse.Namespace, argv: list[str]) -> int:
    slos = parse_goodput(args.goodput)
    for name in ("num_prompts", "input_len", "output_len", "shared_prefix_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.shared_prefix_groups < 0 or (args.shared_prefix_groups and args.dataset):
        raise ValueError("--shared-prefix-groups must be >= 0, and it replaces --dataset (give one of them)")
    if args.request_rate <= 0:
        raise ValueError("--request-rate must be > 0 (or inf)")
    if args.client_processes < 1:
        raise ValueError("--client-processes must be >= 1")
    load_before = os.getloadavg()[0]   # other work on the machine skews latencies; record how much there was
    runs = asyncio.run(_run_all(args, slos)) if args.client_processes == 1 else _run_all_processes(args, slos)
    payload = {"command": "deepserve " + shlex.join(argv), "label": args.label or args.base_url,
               "machine": {**_machine_info(), "load_average_1m_before": round(load_before, 2),
                           "load_average_1m_after": round(os.getloadavg()[0], 2)},
               "runs": runs}
    print(json.dumps(runs, indent=2))
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(payload, f, indent=2)
    plot_path = args.plot or (os.path.splitext(args.output_json)[0] + ".png" if args.output_json else None)
    if plot_path:
        others = [_load_json(p) for p in args.compare]
        if not plot_results([payload, *others], plot_path):
            print("matplotlib is not installed: no plot written")
    return 0


def parse_goodput(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2e") or not value:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2e:MS, got {item!r}")
        slos[name] = float(value)
    return slos


# --- running ------------------------------------------------------------------------------------

async def _run_all(args: argparse.Namespace, slos: dict[str, float]) -> list[dict[str, Any]]:
    # (_client imports httpx here, not at import: `deepserve --help` and `deepserve generate` never load it)
    async with _client(args) as client:
        model = await _model_and_warm_up(client, args)
        prompts = workload_prompts(args)
        runs = []
        for concurrency in args.max_concurrency:
            start = time.perf_counter()
            results = await run_load(client, args, model, prompts, concurrency)
            runs.append(summarize(results, time.perf_counter() - start, slos, _run_info(args, model, prompts,
                                                                                        concurrency)))
        return runs


def _run_info(args: argparse.Namespace, model: str, prompts: list, concurrency: int) -> dict[str, Any]:
    return {"model": model, "endpoint": args.endpoint, "num_prompts": len(prompts),
            "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
            "max_concurrency": concurrency or None, "input_len": args.input_len, "output_len": args.output_len,
            "dataset": args.dataset, "shared_prefix_groups": args.shared_prefix_groups or None,
            "shared_prefix_len": args.shared_prefix_len if args.shared_prefix_groups else None,
            "client_processes": args.client_processes}


def _run_all_processes(args: argparse.Namespace, slos: dict[str, float]) -> list[dict[str, Any]]:
    """`_run_all` from N client processes: the model name and the warm-up here, then for each concurrency the prompts
    dealt round-robin, concurrency and rate split between the processes, which wait at a barrier before sending; the
    run lasts from the first process's start to the last one's end (wall clock, shared by the processes of a host)."""
    import multiprocessing

    async def prepare() -> str:
        async with _client(args) as client:
            return await _model_and_warm_up(client, args)
    model = asyncio.run(prepare())
    prompts = workload_prompts(args)
    n = args.client_processes
    ctx = multiprocessing.get_context("spawn")
    runs = []
    for concurrency in args.max_concurrency:
        if 0 < concurrency < n:
            raise ValueError(f"--max-concurrency {concurrency} is below --client-processes {n}")
        barrier, results = ctx.Barrier(n + 1), ctx.Queue()
        procs = []
        for i in range(n):
            share = argparse.Namespace(**vars(args))
            share.request_rate, share.seed = args.request_rate / n, args.seed + i
            limit = concurrency // n + (i < concurrency % n) if concurrency > 0 else 0
            procs.append(ctx.Process(target=_client_process, daemon=True,
                                     args=(share, model, prompts[i::n], limit, barrier, results)))
        for proc in procs:
            proc.start()
        barrier.wait(timeout=120)       # (a process that died first breaks the barrier: BrokenBarrierError)
        parts = _collect(results, procs, args.request_timeout * len(prompts))
        for proc in procs:
            proc.join()
        merged = [r for part, _, _ in parts for r in part]
        duration = max(end for _, _, end in parts) - min(start for _, start, _ in parts)
        runs.append(summarize(merged, duration, slos, _run_info(args, model, prompts, concurrency)))
    return runs


def _collect(results, procs: list, timeout_s: float) -> list:
    """One (results, start, end) per client process; a RuntimeError if one of them exits without its results."""
    import queue

    parts, deadline = [], time.monotonic() + timeout_s
    while len(parts) < len(procs):
        try:
            parts.append(results.get(timeout=1.0))
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"a client process failed (exit codes {dead}) or the run timed out") from None
    return parts


async def _model_and_warm_up(client: httpx.AsyncClient, args: argparse.Namespace) -> str:
    """The model to ask for, after a warm-up request that is not measured, on a prompt of no workload (seed + 1): it
    must not put a measured prefix in a cache."""
    model = args.model or await _first_model(client)
    warmup = Prompt(load_prompts(None, 1, args.input_len, args.seed + 1)[0])
    await _send(client, _payload(args, model, warmup, max_tokens=2))
    return model


def _client(args: argparse.Namespace):
    import httpx
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    return httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=timeout, limits=limits)


def _client_process(args: argparse.Namespace, model: str, prompts: list[Prompt], concurrency: int, barrier,
                    results) -> None:
    """One client process of _run_all_processes: (its results, start, end)."""
    async def main():
        async with _client(args) as client:
            barrier.wait()
            start = time.time()
            done = await run_load(client, args, model, prompts, concurrency)
            return done, start, time.time()
    results.put(asyncio.run(main()))


async def run_load(client: httpx.AsyncClient, args: argparse.Namespace, model: str, prompts: list[Prompt],
                   concurrency: int) -> list[RequestResult]:
    rng = random.Random(args.seed)
    gate = asyncio.Semaphore(concurrency) if concurrency > 0 else None

    async def one(prompt: Prompt) -> RequestResult:
        if gate is None:
            return await _send(client, _payload(args, model, prompt, args.output_len))
        async with gate:
            return await _send(client, _payload(args, model, prompt, args.output_len))

    tasks = []
    for i, prompt in enumerate(prompts):
        tasks.append(asyncio.create_task(one(prompt)))
        if math.isfinite(args.request_rate) and i + 1 < len(prompts):
            await asyncio.sleep(rng.expovariate(args.request_rate))
    return list(await asyncio.gather(*tasks))


def _payload(args: argparse.Namespace, model: str, prompt: Prompt, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if args.ignore_eos:     # a vLLM extension: servers without it may refuse the field, so only send it when set
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        system = [{"role": "system", "content": prompt.system}] if prompt.system else []
        body["messages"] = [*system, {"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = f"{prompt.system}\n\n{prompt.text}" if prompt.system else prompt.text
    return body


async def _send(client: httpx.AsyncClient, payload: dict[str, Any]) -> RequestResult:
    import httpx

    path = "/v1/chat/completions" if "messages" in payload else "/v1/completions"
    result = RequestResult(ok=False)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", path, json=payload) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"])[:200]
                    return result
                if chunk.get("usage"):
                    _read_usage(result, chunk["usage"])
                if any(_chunk_text(c) for c in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if result.ttft_s is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.e2e_s = time.perf_counter() - start
    if result.output_tokens == 0:   # a server without usage chunks: count text chunks instead
        result.output_tokens = len(result.itl_s) + (result.ttft_s is not None)
    result.ok = True
    return result


def _read_usage(result: RequestResult, usage: dict[str, Any]) -> None:
    result.prompt_tokens = usage.get("prompt_tokens") or 0
    result.output_tokens = usage.get("completion_tokens") or 0
    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def _chunk_text(choice: dict[str, Any]) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def _first_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


# --- prompts ------------------------------------------------------------------------------------

def workload_prompts(args: argparse.Namespace) -> list[Prompt]:
    if args.shared_prefix_groups:
        return shared_prefix_prompts(args.shared_prefix_groups, args.shared_prefix_len, args.num_prompts,
                                     args.input_len, args.seed)
    return [Prompt(p) for p in load_prompts(args.dataset, args.num_prompts, args.input_len, args.seed)]


def shared_prefix_prompts(groups: int, prefix_len: int, num_prompts: int, input_len: int, seed: int) -> list[Prompt]:
    """num_prompts requests spread evenly over `groups` system prompts, each with its own question, shuffled: a
    router sees every prefix come back at random times, not in runs that any policy would keep together."""
    rng = random.Random(seed)
    systems = [_random_words(rng, prefix_len) for _ in range(groups)]
    prompts = [Prompt(_random_words(rng, input_len), systems[i % groups]) for i in range(num_prompts)]
    rng.shuffle(prompts)
    return prompts


def _random_words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(count))


def load_prompts(dataset: str | None, num_prompts: int, input_len: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    if dataset is None:
        return [_random_words(rng, input_len) for _ in range(num_prompts)]
    with open(dataset) as f:
        records = json.load(f)
    prompts = [_first_human_turn(r) for r in records]
    prompts = [p for p in prompts if p]
    if not prompts:
        raise ValueError(f"{dataset}: no conversation with a human turn (ShareGPT format expected)")
    rng.shuffle(prompts)
    return [prompts[i % len(prompts)] for i in range(num_prompts)]


def _first_human_turn(record: Any) -> str | None:
    turns = record.get("conversations") if isinstance(record, dict) else None
    for turn in turns or []:
        if isinstance(turn, dict) and turn.get("from") in ("human", "user") and isinstance(turn.get("value"), str):
            return turn["value"]
    return None


# --- summarizing --------------------------------------------------------------------------------

def summarize(results: list[RequestResult], duration_s: float, slos: dict[str, float],
              setup: dict[str, Any]) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens for r in done)
    cached_tokens = sum(r.cached_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    good = [r for r in done if _meets(r, slos)]
    return {
        **setup,
        "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": round(duration_s, 3),
        "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "total_cached_tokens": cached_tokens,
        "prefix_cache_hit_rate": round(cached_tokens / input_tokens, 4) if input_tokens else None,
        "request_throughput": round(len(done) / duration_s, 4),
        "output_throughput": round(output_tokens / duration_s, 3),
        "total_token_throughput": round((input_tokens + output_tokens) / duration_s, 3),
        "ttft_ms": latency_stats([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": latency_stats([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": latency_stats([gap for r in done for gap in r.itl_s]),
        "e2e_ms": latency_stats([r.e2e_s for r in done]),
        "goodput": {"slo_ms": slos, "requests_per_s": round(len(good) / duration_s, 4),
                    "fraction": round(len(good) / len(results), 4) if results else 0.0} if slos else None,
    }


def latency_stats(seconds: list[float]) -> dict[str, float | None]:
    if not seconds:
        return {"mean": None, **{name: None for name, _ in _PERCENTILES}}
    ms = sorted(s * 1e3 for s in seconds)
    stats = {"mean": round(statistics.fmean(ms), 3)}
    for name, q in _PERCENTILES:
        stats[name] = round(percentile(ms, q), 3)
    return stats


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on an already sorted list."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    position = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


def _meets(result: RequestResult, slos: dict[str, float]) -> bool:
    measured = {"ttft": result.ttft_s, "tpot": result.tpot_s, "e2e": result.e2e_s}
    for name, limit_ms in slos.items():
        value = measured[name]
        if value is not None and value * 1e3 > limit_ms:
            return False
    return True


# --- plotting -----------------------------------------------------------------------------------

def plot_results(payloads: list[dict[str, Any]], path: str) -> bool:
    """Throughput and latencies against concurrency, one line per server. False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    # (result key, statistic, title, log y-axis: latencies span orders of magnitude across servers)
    panels = [("output_throughput", None, "output tokens/s", False), ("ttft_ms", "median", "TTFT median (ms)", True),
              ("tpot_ms", "median", "TPOT median (ms)", False), ("e2e_ms", "p99", "E2E p99 (ms)", True)]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, stat, title, log_y) in zip(axes.flat, panels):
        for payload in payloads:
            runs = payload["runs"]
            xs = [r["max_concurrency"] or r["num_prompts"] for r in runs]
            ys = [r[key] if stat is None else r[key][stat] for r in runs]
            ax.plot(xs, ys, marker="o", label=payload.get("label", "server"))
        ax.set_xscale("log", base=2)
        if log_y:
            ax.set_yscale("log")
        ax.set_xlabel("max concurrency")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes.flat[0].legend()
    first = payloads[0]["runs"][0]
    fig.suptitle(f"{first['model']}: {first['num_prompts']} prompts, {first['input_len']} in / "
                 f"{first['output_len']} out tokens, rate {first['request_rate']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _load_json(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def _machine_info() -> dict[str, Any]:
    from deepserve.bench.throughput import machine_info
    return machine_info()
