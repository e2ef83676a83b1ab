"""`deepserve serve --pd P:D [--replicas P+D] --kv-store JSON`: a disaggregated group on one host.

P `serve --role prefill` and D `serve --role decode` children on free loopback ports, all with the same flags and
so the same shared KV store (disk or Redis), and a router on `--host:--port` that sends each request to a prefill
child first, then to a decode child by its policy (router/pd.py). Children with the colocated cluster's thread
split (OMP_NUM_THREADS = cores / children unless set). No restart or autoscaling here (local_cluster.py has them
for colocated replicas): a dead prefill child only costs its requests the prefill (the decode child computes).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile

from deepserve.router.config import RouterConfig
from deepserve.router.local_cluster import EngineProcess, child_argv
from deepserve.router.server import serve_router
from deepserve.serving.openai.keys import api_keys
from deepserve.serving.openai.pd_role import check_role

logger = logging.getLogger(__name__)

_PD_FLAGS = ("--pd", "--role")


def without_flags(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """`argv` without the flags `names` and their values (`--flag value` or `--flag=value`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg.split("=", 1)[0] in names:
            skip = "=" not in arg
            continue
        out.append(arg)
    return out


def pd_children(serve_argv: list[str], prefill: int, decode: int) -> list[tuple[str, list[str]]]:
    """(role, argv) of each child: the serve flags the group does not set itself, plus the role."""
    base = without_flags(child_argv(serve_argv), _PD_FLAGS)
    return [(role, [*base, "--role", role]) for role, n in (("prefill", prefill), ("decode", decode))
            for _ in range(n)]


def run_pd_cluster(args: argparse.Namespace, serve_argv: list[str]) -> int:
    prefill, decode = args.pd
    if args.replicas is not None and args.replicas.maximum != prefill + decode:
        raise ValueError(f"--replicas {args.replicas.maximum} must equal P+D of --pd {prefill}:{decode}")
    check_role("prefill", args.kv_store)
    children = pd_children(serve_argv, prefill, decode)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // len(children))))
    engines = [(role, EngineProcess(argv, env)) for role, argv in children]
    with tempfile.TemporaryDirectory(prefix="deepserve-pd-") as tmp:
        try:
            for _, engine in engines:
                engine.start()
            for _, engine in engines:
                engine.wait_healthy()
            replicas_file = os.path.join(tmp, "replicas")
            with open(replicas_file, "w", encoding="utf-8") as f:
                f.write("".join(f"{e.url}\n" for role, e in engines if role == "decode"))
            config = RouterConfig(replicas_file=replicas_file, policy=args.router_policy,
                                  prefill_replicas=[e.url for role, e in engines if role == "prefill"],
                                  api_keys=api_keys(args), rate_limit=args.rate_limit,
                                  max_body_bytes=args.max_body_bytes)
            logger.warning("prefill: %s; decode: %s", ", ".join(config.prefill_replicas),
                           ", ".join(e.url for role, e in engines if role == "decode"))
            return serve_router(config, args.host, args.port, args.uvicorn_log_level, args.drain_timeout)
        finally:
            for _, engine in engines:
                engine.stop()
