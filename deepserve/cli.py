"""`deepserve generate | serve | router | env | bench throughput | bench latency | bench serve`.

Every EngineArgs field is also a flag (`--max-model-len`, `--enable-prefix-caching/--no-enable-...`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import shlex
import sys
from typing import Any

from deepserve import envs
from deepserve.config import QUANTIZATIONS, EngineArgs
from deepserve.router.options import add_cluster_args, add_router_args, runs_a_cluster

_SAMPLING_FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n",
                    "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
                    "ignore_eos", "logprobs", "stop_token_ids"}


# Short flags, as vLLM and SGLang users type them: --tp 2 --dp 2 --ep 4.
_PARALLEL_ALIASES = {"tensor_parallel_size": "--tp", "data_parallel_size": "--dp", "expert_parallel_size": "--ep"}


def add_engine_args(parser: argparse.ArgumentParser, skip: set[str] = frozenset()) -> None:
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool", "bool | None"):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.name in ("kv_cache_memory_bytes", "max_model_len", "max_num_batched_tokens",
                        "cuda_graph_max_batch_size"):
            group.add_argument(flag, type=int, default=f.default)
        elif f.name in ("block_size", "max_num_seqs", "seed", "eplb_interval", "eplb_window",
                        "num_redundant_experts"):
            group.add_argument(flag, type=int, default=f.default)
        elif f.name in _PARALLEL_ALIASES:
            group.add_argument(flag, _PARALLEL_ALIASES[f.name], type=int, default=f.default, dest=f.name)
        elif f.name == "quantization":
            group.add_argument(flag, choices=list(QUANTIZATIONS), default=None)
        elif f.name == "gpu_memory_utilization":
            group.add_argument(flag, type=float, default=f.default)
        else:
            group.add_argument(flag, type=str, default=f.default)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineArgs) if hasattr(args, f.name)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepserve", description="LLM inference engine")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate completions for a prompt or a JSONL file of prompts")
    gen.add_argument("prompt", nargs="?", help="the prompt text")
    gen.add_argument("--input", help="JSONL file: one {'prompt'|'messages'|'prompt_token_ids', ...} per line")
    gen.add_argument("--output", help="JSONL file for results (default: stdout)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    add_engine_args(gen)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    from deepserve.serving.openai.options import add_serve_args      # light: no fastapi, no engine
    add_serve_args(serve)
    add_cluster_args(serve)
    add_engine_args(serve)

    router = sub.add_parser("router", help="route the OpenAI API over several replicas (cache-aware, failover)")
    add_router_args(router)

    sub.add_parser("env", help="print every DEEPSERVE_* environment variable: its value, default and meaning")

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    tp = bench_sub.add_parser("throughput", help="offline throughput on random prompts")
    tp.add_argument("--num-prompts", type=int, default=64)
    tp.add_argument("--input-len", type=int, default=128)
    tp.add_argument("--output-len", type=int, default=128)
    tp.add_argument("--output-json")
    add_engine_args(tp)
    lat = bench_sub.add_parser("latency", help="prefill and per-token decode time for one batch")
    lat.add_argument("--batch-size", type=int, default=1)
    lat.add_argument("--input-len", type=int, default=32)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--output-json")
    add_engine_args(lat)
    bench_serve = bench_sub.add_parser("serve", help="load a running OpenAI-compatible server (Poisson arrivals)")
    from deepserve.bench.serve import add_bench_serve_args
    add_bench_serve_args(bench_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    envs.warn_unknown_variables()
    try:
        if args.command == "env":
            print(envs.describe())
            return 0
        if args.command == "generate":
            return _generate(args)
        if args.command == "router":
            from deepserve.router.server import run_router
            return run_router(args)
        if args.command == "serve" and runs_a_cluster(args):
            raw = argv if argv is not None else sys.argv[1:]
            if args.pd is not None:
                from deepserve.router.pd_cluster import run_pd_cluster
                return run_pd_cluster(args, raw[raw.index("serve") + 1:])
            from deepserve.router.local_cluster import run_local_cluster
            return run_local_cluster(args, raw[raw.index("serve") + 1:])
        if args.command == "serve":
            from deepserve.serving.openai.server import run_server
            return run_server(args, engine_kwargs(args))
        if args.bench_command == "serve":
            from deepserve.bench.serve import run_from_args
            return run_from_args(args, argv if argv is not None else sys.argv[1:])
        return _bench(args, argv if argv is not None else sys.argv[1:])
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def _generate(args: argparse.Namespace) -> int:
    from deepserve.llm import LLM
    from deepserve.sampling_params import SamplingParams

    if (args.prompt is None) == (args.input is None):
        raise ValueError("give either a PROMPT or --input FILE")
    base = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                seed=args.seed)
    llm = LLM(**engine_kwargs(args))
    if args.prompt is not None:
        params = SamplingParams(**base)
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
        else:
            out = llm.generate(args.prompt, params, use_tqdm=False)[0]
        print(out.outputs[0].text)
        return 0
    records = _read_jsonl(args.input)
    results = []
    for i, rec in enumerate(records):
        params = SamplingParams(**{**base, **{k: v for k, v in rec.items() if k in _SAMPLING_FIELDS}})
        results.append((rec, params))
    outputs = _run_records(llm, results, args.chat)
    sink = open(args.output, "w") if args.output else sys.stdout
    try:
        for (rec, _), out in zip(results, outputs):
            c = out.outputs[0]
            line = {"prompt": rec.get("prompt"), "text": c.text, "token_ids": c.token_ids,
                    "finish_reason": c.finish_reason, "num_prompt_tokens": len(out.prompt_token_ids),
                    "num_cached_tokens": out.num_cached_tokens}
            if "id" in rec:
                line["id"] = rec["id"]
            sink.write(json.dumps(line, ensure_ascii=False) + "\n")
    finally:
        if sink is not sys.stdout:
            sink.close()
    return 0


def _run_records(llm, records, chat: bool):
    tokenizer = llm.get_tokenizer()
    prompts = []
    for rec, _ in records:
        if "messages" in rec or (chat and "prompt" in rec):
            messages = rec.get("messages") or [{"role": "user", "content": rec["prompt"]}]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        elif "prompt_token_ids" in rec:
            prompts.append({"prompt_token_ids": rec["prompt_token_ids"]})
        elif "prompt" in rec:
            prompts.append(rec["prompt"])
        else:
            raise ValueError("each input line needs 'prompt', 'messages' or 'prompt_token_ids'")
    return llm.generate(prompts, [p for _, p in records], use_tqdm=True)


def _read_jsonl(path: str) -> list[dict[str, Any]]:
    records = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            if isinstance(rec, str):
                rec = {"prompt": rec}
            records.append(rec)
    return records


def _bench(args: argparse.Namespace, argv: list[str]) -> int:
    from deepserve.bench.throughput import machine_info, run_latency, run_throughput, write_json
    from deepserve.llm import LLM

    kwargs = engine_kwargs(args)
    if kwargs.get("load_format") == "dummy" and kwargs.get("model") and not _has_tokenizer(kwargs["model"]):
        kwargs["skip_tokenizer_init"] = True
    llm = LLM(**kwargs)
    if args.bench_command == "throughput":
        result = run_throughput(llm, args.num_prompts, args.input_len, args.output_len, seed=args.seed)
    else:
        result = run_latency(llm, args.batch_size, args.input_len, args.output_len, seed=args.seed)
    payload = {"command": "deepserve " + shlex.join(argv), "engine": kwargs, "result": result,
               "machine": machine_info()}
    print(json.dumps(result, indent=2))
    if args.output_json:
        write_json(args.output_json, payload)
    return 0


def _has_tokenizer(path: str) -> bool:
    import os
    return path.endswith(".gguf") or os.path.exists(os.path.join(path, "tokenizer.json"))


if __name__ == "__main__":
    sys.exit(main())
