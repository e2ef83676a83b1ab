"""The router's FastAPI app: the OpenAI API in front of the replicas, with the server's own key check, rate
limit and body-size limit in front (the same middlewares, auth.py and rate_limit.py, so a client sees the
same 401 / 429 / 413 from the router as from a server).

Request path: BodySizeLimit (413) -> AccessGuard (401, 429) -> endpoint -> policy -> replica.
Open paths (health, metrics, version) need no key, as on the server. /health answers 200 while at least
one replica is eligible, so a load balancer in front of several routers drops one with no replica.
The lifespan owns the HTTP client and the health loop; SIGHUP re-reads the replicas file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from deepserve.router.autoscale import desired_replicas
from deepserve.router.circuit_breaker import CircuitBreaker
from deepserve.router.config import RouterConfig
from deepserve.router.health import HealthChecker
from deepserve.router.metrics import CONTENT_TYPE, RouterMetrics
from deepserve.router.pd import PrefillStage
from deepserve.router.policies import CacheAware, Policy, make_policy
from deepserve.router.proxy import Proxy, forward_headers
from deepserve.router.replica_set import ReplicaSet
from deepserve.router.routing_key import routed_request
from deepserve.serving.openai.auth import AccessGuard
from deepserve.serving.openai.body_limit import BodySizeLimit
from deepserve.serving.openai.errors import OpenAIError, error_response, install_error_handlers
from deepserve.serving.openai.rate_limit import RateLimiter
from deepserve.serving.openai.streaming import ClientDisconnected, first_completed, wait_for_disconnect
from deepserve.version import __version__

logger = logging.getLogger(__name__)

# Answered by the policy (prefix affinity, load); the other API paths go to any eligible replica.
ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")
PASSTHROUGH_POST = ("/tokenize", "/detokenize")
_CLIENT_LEFT = 499


@dataclass
class RouterState:
    config: RouterConfig
    replicas: ReplicaSet
    policy: Policy
    metrics: RouterMetrics
    proxy: Proxy | None = None            # set by the lifespan, which owns the HTTP client
    health: HealthChecker | None = None
    prefill: PrefillStage | None = None   # set by the lifespan when there are prefill replicas

    @classmethod
    def create(cls, config: RouterConfig) -> RouterState:
        replicas = ReplicaSet(config.replicas, config.replicas_file,
                              lambda: CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s))
        policy = make_policy(config)
        metrics = RouterMetrics(replicas, lambda: desired_replicas(
            replicas, config.autoscale_target_ttft_ms, config.autoscale_min, config.autoscale_max))
        return cls(config, replicas, policy, metrics)

    def describe(self) -> list[dict[str, Any]]:
        tree = self.policy.tree if isinstance(self.policy, CacheAware) else None
        return [{"url": r.url, "healthy": r.healthy, "eligible": r.is_eligible(), "removed": r.removed,
                 "circuit": r.breaker.state, "in_flight": r.in_flight, "in_flight_tokens": r.in_flight_tokens,
                 "load": r.load, "report": vars(r.report) if r.report is not None else None,
                 "cached_chars": tree.tenant_chars(r.url) if tree is not None else None}
                for r in [*self.replicas, *self.replicas.draining()]]


def build_router_app(config: RouterConfig) -> FastAPI:
    state = RouterState.create(config)
    app = FastAPI(title="deepserve router", version=__version__, lifespan=_lifespan(state),
                  description="OpenAI-compatible API routed over deepserve replicas")
    app.state.router = state
    install_error_handlers(app)
    for path in ROUTED_PATHS:
        app.add_api_route(path, _forward(state, use_policy=True), methods=["POST"])
    for path in PASSTHROUGH_POST:
        app.add_api_route(path, _forward(state, use_policy=False), methods=["POST"])
    app.add_api_route("/v1/models", _forward(state, use_policy=False), methods=["GET"])
    app.add_api_route("/health", _health(state), methods=["GET"])
    app.add_api_route("/metrics", _metrics(state), methods=["GET"])
    app.add_api_route("/version", _version, methods=["GET"])
    app.add_api_route("/router/replicas", _replicas(state), methods=["GET"])
    limiter = RateLimiter(config.rate_limit) if config.rate_limit is not None else None
    app.add_middleware(AccessGuard, api_keys=config.api_keys, rate_limiter=limiter)     # added last = runs first
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    return app


def _lifespan(state: RouterState):
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        config = state.config
        timeout = httpx.Timeout(connect=config.connect_timeout_s, read=config.read_timeout_s, write=60.0,
                                pool=None)
        # No pool limit: a stream holds its connection for its whole life, and a cap would queue requests
        # behind it in the router, invisible to every load count. trust_env off: no proxy for the replicas.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
            state.proxy = Proxy(config, state.replicas, state.policy, client, state.metrics)
            if config.prefill_replicas:
                state.prefill = PrefillStage(config.prefill_replicas, client, config.prefill_timeout_s)
            state.health = HealthChecker(state.replicas, client, config.health_interval_s, config.health_timeout_s,
                                         config.unhealthy_after, config.load_reports, after_round=state.policy.maintain)
            state.replicas.on_added.append(state.health.probe_soon)
            state.replicas.on_removed.append(lambda replica: state.policy.forget(replica.url))
            await state.health.check_all()          # serve knowing which replicas are up
            loop_task = asyncio.get_running_loop().create_task(_health_loop(state.health))
            _on_sighup(state.replicas.reload)
            try:
                yield
            finally:
                loop_task.cancel()
                await asyncio.gather(loop_task, return_exceptions=True)
    return lifespan


async def _health_loop(health: HealthChecker) -> None:
    await asyncio.sleep(health.interval_s)          # the first round ran at start-up
    await health.run()


def _on_sighup(reload) -> None:
    """SIGHUP re-reads the replicas file (only where the loop can take signals: the main thread, POSIX)."""
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError, AttributeError):
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)


def _forward(state: RouterState, use_policy: bool):
    async def forward(request: Request) -> Response:
        body = await request.body()
        routed = routed_request(request.url.path, body, request.method)
        assert state.proxy is not None
        work = _prefill_then_forward(state, request.url.path, body, routed, forward_headers(request.headers),
                                     use_policy)
        try:
            # A client that leaves while its request waits (for a replica, a retry, the answer) frees it.
            return await first_completed(work, wait_for_disconnect(request.receive))
        except ClientDisconnected:
            return Response(status_code=_CLIENT_LEFT)
    return forward


async def _prefill_then_forward(state: RouterState, path: str, body: bytes, routed, headers, use_policy: bool):
    """Disaggregated (prefill replicas configured): a prefill replica computes the prompt into the KV store first."""
    if state.prefill is not None and use_policy:
        await state.prefill.prefill(path, body, headers)
    return await state.proxy.forward(routed, headers, use_policy)


def _health(state: RouterState):
    async def health() -> Response:
        if state.replicas.eligible():
            return Response(status_code=200)
        return error_response(OpenAIError(503, "no healthy replica", code="no_replica"))
    return health


def _metrics(state: RouterState):
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)
    return metrics


def _replicas(state: RouterState):
    async def replicas() -> JSONResponse:
        return JSONResponse({"policy": state.policy.name, "replicas": state.describe()})
    return replicas


async def _version() -> dict[str, str]:
    return {"version": __version__}
