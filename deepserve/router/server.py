"""`deepserve router`: the flags (options.py) -> RouterConfig -> the app (app.py), run by uvicorn until SIGTERM /
SIGINT (uvicorn stops listening and lets the streams in flight finish)."""

from __future__ import annotations

import argparse
import logging

from deepserve.router.config import RouterConfig
from deepserve.router.options import router_config
from deepserve.serving.openai.signals import run_until_signal

logger = logging.getLogger(__name__)


def run_router(args: argparse.Namespace) -> int:
    return serve_router(router_config(args), args.host, args.port, args.uvicorn_log_level)


def serve_router(config: RouterConfig, host: str, port: int, log_level: str = "warning",
                 drain_timeout_s: float = 300.0) -> int:
    import uvicorn

    from deepserve.router.app import build_router_app

    app = build_router_app(config)
    uvicorn_config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                                    timeout_graceful_shutdown=int(drain_timeout_s))
    logger.warning("routing %s over %d replica(s) on http://%s:%d", config.policy,
                   len(config.replicas) + (1 if config.replicas_file else 0), host, port)
    server = uvicorn.Server(uvicorn_config)
    run_until_signal(server)
    return 0 if server.started else 1
