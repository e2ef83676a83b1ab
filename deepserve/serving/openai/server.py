"""`deepserve serve`: load the engine, build the app, run uvicorn until SIGTERM / SIGINT.

The engine loop runs on the main thread and uvicorn on a second one. On SIGTERM uvicorn stops listening,
lets in-flight requests (streams included) finish for up to `--drain-timeout` seconds, then the app's
lifespan drains the engine loop; the process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from typing import Any

from deepserve.serving.openai.context import (
    DEFAULT_MAX_BODY_BYTES,
    ServerConfig,
    ServerContext,
)
from deepserve.serving.openai.tool_parsers import TOOL_CALL_PARSERS

logger = logging.getLogger(__name__)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--api-key", action="append", default=[], dest="api_keys", metavar="KEY",
                       help="accept this key (repeat for several); without any, no authentication")
    group.add_argument("--rate-limit", type=float, default=None, metavar="R",
                       help="requests per second allowed per key (per client address without keys)")
    group.add_argument("--max-queue", type=int, default=None, metavar="N",
                       help="answer 503 while N requests are already waiting to be scheduled")
    group.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                       help="answer 413 to larger request bodies")
    group.add_argument("--served-model-name", action="append", default=[], dest="served_model_names",
                       metavar="NAME", help="name(s) clients use for the model (default: the model file's name)")
    group.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default="auto",
                       help="how tool calls are written in the output (auto: from the chat template)")
    group.add_argument("--drain-timeout", type=float, default=300.0,
                       help="seconds to let in-flight requests finish after SIGTERM")
    group.add_argument("--uvicorn-log-level", default="warning")


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(served_model_names=args.served_model_names, api_keys=args.api_keys,
                        rate_limit=args.rate_limit, max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                        tool_call_parser=args.tool_call_parser)


def run_server(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    """Engine loop on this (main) thread, HTTP on a second one; returns 0 after a drained SIGTERM / SIGINT."""
    import uvicorn

    from deepserve.config import EngineArgs
    from deepserve.serving.openai.app import build_app

    config = server_config(args)        # validate the flags before the (slow) model load
    # The engine lives on the main thread: torch's CPU kernels are much slower on other threads (AsyncLLMEngine).
    ctx = ServerContext.create(EngineArgs.from_kwargs(**engine_kwargs), config, run_engine_in_thread=False)
    app = build_app(ctx, drain_timeout_s=args.drain_timeout)
    uvicorn_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                    timeout_graceful_shutdown=int(args.drain_timeout), access_log=False)
    http = uvicorn.Server(uvicorn_config)
    http_thread = threading.Thread(target=_serve_http, args=(http, ctx), name="deepserve-http")
    _stop_http_on_signals(http)
    http_thread.start()
    ctx.engine.run_loop()               # returns once the app's shutdown (or a failed start) stopped it
    http_thread.join()
    return 0 if http.started else 1


def _serve_http(http, ctx: ServerContext) -> None:
    """Run uvicorn; whatever way it ends (drained shutdown, failed start), stop the engine loop after it."""
    try:
        http.run()
    finally:
        ctx.engine.request_stop(drain=True)


def _stop_http_on_signals(http) -> None:
    """uvicorn installs no signal handlers off the main thread; these do its part: the first SIGTERM / SIGINT
    starts its graceful shutdown (stop listening, let in-flight requests finish), a second one forces it."""
    def on_signal(signum: int, _frame) -> None:
        logger.warning("received %s: draining in-flight requests, then stopping", signal.Signals(signum).name)
        if http.should_exit:
            http.force_exit = True
        http.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
