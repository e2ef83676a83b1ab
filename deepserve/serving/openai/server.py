"""`deepserve serve`: turn the flags (options.py) into a ServerConfig, load the engine, build the app, run
uvicorn until SIGTERM / SIGINT.

On SIGTERM uvicorn stops listening, lets in-flight requests (streams included) finish for up to
`--drain-timeout` seconds, then the app's lifespan drains the engine loop; the process exits 0.

API keys come from three sources, all accepted together (keys.py, shared with `deepserve router`):
DEEPSERVE_API_KEY (comma-separated), `--api-key-file` (one per line) and `--api-key`.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import threading
from typing import Any

from deepserve import envs
from deepserve.serving.openai.context import ServerConfig, ServerContext
from deepserve.serving.openai.keys import api_keys, read_api_key_file
from deepserve.serving.openai.pd_role import FlushBeforeAnswer, check_role
from deepserve.serving.openai.signals import run_until_signal

__all__ = ["api_keys", "read_api_key_file", "run_server", "server_config"]

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
    in_process = getattr(args, "engine_in_process", None)
    if in_process is None:
        in_process = envs.DEEPSERVE_ENGINE_IN_PROCESS        # None (unset): chosen by device in ServerContext
    return ServerConfig(served_model_names=args.served_model_names, api_keys=api_keys(args),
                        rate_limit=args.rate_limit, max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                        tool_call_parser=args.tool_call_parser, engine_in_process=in_process, **cors)


def run_server(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    import uvicorn

    from deepserve.config import EngineArgs
    from deepserve.serving.openai.app import build_app

    from deepserve.engine.multi_rank_engine import serve_if_worker_rank

    config = server_config(args)        # validate the flags before the (slow) model load
    role = getattr(args, "role", "colocated")
    check_role(role, engine_kwargs.get("kv_store"))
    if role == "prefill" and not config.engine_in_process:
        # FlushBeforeAnswer waits on the engine's KV store connector, which lives where the engine does.
        logger.warning("--role prefill: the engine runs on a thread of the server's process (no engine process)")
        config.engine_in_process = True
    engine_args = EngineArgs.from_kwargs(**engine_kwargs)
    serve_if_worker_rank(engine_args)   # under torchrun only rank 0 serves HTTP; the others serve rank 0
    ctx = ServerContext.create(engine_args, config)
    app = build_app(ctx, drain_timeout_s=args.drain_timeout)
    warm_up_structured_outputs(ctx)
    if role == "prefill":
        app = FlushBeforeAnswer(app, ctx.engine.engine.kv_store)
    uvicorn_config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                    timeout_graceful_shutdown=int(args.drain_timeout), access_log=False)
    logger.warning("serving %s on http://%s:%d", ctx.model_name, args.host, args.port)
    http = uvicorn.Server(uvicorn_config)
    run_until_signal(http)
    return 0 if http.started else 1


def warm_up_structured_outputs(ctx: ServerContext) -> threading.Thread | None:
    """Import xgrammar and build its vocabulary view in the background while the server starts: the first
    structured request would otherwise pay ~2-3 s on the engine thread (the import) and in its compile."""
    compiler = ctx.engine.engine.grammar_compiler
    if compiler is None:
        return None     # an engine process warms its own compiler up (engine_process.py)
    if compiler.tokenizer is None or importlib.util.find_spec("xgrammar") is None:
        return None

    def prepare() -> None:
        try:
            compiler.prepare()
        except Exception:   # structured requests will report the failure themselves
            logger.warning("structured outputs: preparing the grammar compiler failed", exc_info=True)

    thread = threading.Thread(target=prepare, name="deepserve-grammar-warmup", daemon=True)
    thread.start()
    return thread
