"""`deepserve serve`: load the engine, build the app, run uvicorn until SIGTERM / SIGINT.

On SIGTERM uvicorn stops listening, lets in-flight requests (streams included) finish for up to
`--drain-timeout` seconds, then the app's lifespan drains the engine loop; the process exits 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
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
    import uvicorn

    from deepserve.config import EngineArgs
    from deepserve.serving.openai.app import build_app

    config = server_config(args)        # validate the flags before the (slow) model load
    ctx = ServerContext.create(EngineArgs.from_kwargs(**engine_kwargs), config)
    app = build_app(ctx, drain_timeout_s=args.drain_timeout)
    uvicorn_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                    timeout_graceful_shutdown=int(args.drain_timeout), access_log=False)
    logger.warning("serving %s on http://%s:%d", ctx.model_name, args.host, args.port)
    http = uvicorn.Server(uvicorn_config)
    _run_until_signal(http)
    return 0 if http.started else 1


def _run_until_signal(server) -> None:
    """Run uvicorn; after a SIGTERM / SIGINT it drains and returns, and then this returns too (exit 0).

    uvicorn re-raises the signal it caught once it has shut down, to the handler that was in place before
    it started; a no-op handler here turns that into a normal return instead of death by signal.
    """
    handled = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.signal(sig, _note_signal) for sig in handled}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _note_signal(signum: int, _frame) -> None:
    logger.warning("received %s: drained and stopped", signal.Signals(signum).name)
