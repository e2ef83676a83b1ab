"""`deepserve serve`: turn the flags (options.py) into a ServerConfig, load the engine, build the app, run
uvicorn until SIGTERM / SIGINT.

On SIGTERM uvicorn stops listening, lets in-flight requests (streams included) finish for up to
`--drain-timeout` seconds, then the app's lifespan drains the engine loop; the process exits 0.

API keys come from three sources, all accepted together: DEEPSERVE_API_KEY (comma-separated),
`--api-key-file` (one per line) and `--api-key`. The first two keep keys out of the process's command line,
which every user of the machine can read (`ps`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import stat
from typing import Any

from deepserve import envs
from deepserve.serving.openai.context import ServerConfig, ServerContext

logger = logging.getLogger(__name__)


def server_config(args: argparse.Namespace) -> ServerConfig:
    if not args.allowed_origins:
        given = {"--allowed-methods": args.allowed_methods is not None,
                 "--allowed-headers": args.allowed_headers is not None, "--allow-credentials": args.allow_credentials}
        stray = [flag for flag, is_given in given.items() if is_given]
        if stray:
            raise ValueError(f"{', '.join(stray)} needs --allowed-origins (CORS is off without it)")
    cors = {"allowed_origins": args.allowed_origins, "allow_credentials": args.allow_credentials}
    if args.allowed_methods is not None:
        cors["allowed_methods"] = args.allowed_methods
    if args.allowed_headers is not None:
        cors["allowed_headers"] = args.allowed_headers
    return ServerConfig(served_model_names=args.served_model_names, api_keys=api_keys(args),
                        rate_limit=args.rate_limit, max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                        tool_call_parser=args.tool_call_parser, **cors)


def api_keys(args: argparse.Namespace) -> list[str]:
    """The keys of all three sources (flags, files, DEEPSERVE_API_KEY), each once, in that order."""
    if args.api_keys:
        logger.warning("a key given with --api-key is visible to every user of this machine (ps); "
                       "prefer DEEPSERVE_API_KEY or --api-key-file")
    keys = list(args.api_keys)
    for path in args.api_key_files:
        keys += read_api_key_file(path)
    keys += envs.DEEPSERVE_API_KEY
    return list(dict.fromkeys(keys))


def read_api_key_file(path: str) -> list[str]:
    """One key per line; blank lines and lines starting with # are skipped. A file with no key is an error:
    the server would otherwise run without authentication, which is not what naming a key file asks for."""
    with open(path, encoding="utf-8") as f:
        keys = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ValueError(f"--api-key-file {path} holds no key")
    if os.stat(path).st_mode & (stat.S_IRGRP | stat.S_IROTH):
        logger.warning("%s is readable by other users; `chmod 600 %s` keeps the keys private", path, path)
    return keys


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
