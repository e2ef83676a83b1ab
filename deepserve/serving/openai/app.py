"""The FastAPI app: routes, error handlers, and the middlewares in front (refusal count, CORS, body size,
then key + rate limit).

Request path:  RefusalCounter -> CORS (only with allowed origins) -> BodySizeLimit (413) -> AccessGuard (401,
429) -> FastAPI validation (400) -> endpoint. CORS sits outside the key check, so that a browser's preflight
(which carries no key) is answered and the refusals carry CORS headers the browser lets its page read.
The app's lifespan ends with a drain: uvicorn stops accepting connections on SIGTERM and waits for the
in-flight ones, then the engine loop finishes whatever is left and stops.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

from deepserve.serving.openai.auth import AccessGuard
from deepserve.serving.openai.body_limit import BodySizeLimit
from deepserve.serving.openai.chat import ChatEndpoint
from deepserve.serving.openai.completions import CompletionsEndpoint
from deepserve.serving.openai.context import ServerContext
from deepserve.serving.openai.errors import (
    OpenAIError,
    error_response,
    install_error_handlers,
)
from deepserve.serving.openai.metrics import CONTENT_TYPE
from deepserve.serving.openai.protocol import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    VersionResponse,
    bound_token_ids,
)
from deepserve.serving.openai.rate_limit import RateLimiter
from deepserve.serving.openai.refusals import RefusalCounter
from deepserve.serving.openai.tokenization import TokenizationEndpoints
from deepserve.version import __version__

_ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 503)}
_STREAM = {"content": {"text/event-stream": {}}, "description": "with `stream: true`: server-sent events"}
# /health answers with an empty body (as vLLM's does, for load balancers): say so, rather than FastAPI's
# default of an application/json 200.
_HEALTH = {200: {"description": "the engine is running (empty body)", "content": {}},
           503: {"model": ErrorResponse, "description": "the engine is not running"}}
_METRICS = {200: {"description": "Prometheus text format", "content": {CONTENT_TYPE.split(";")[0]: {}}}}


def build_app(ctx: ServerContext, drain_timeout_s: float | None = None) -> FastAPI:
    app = FastAPI(title="deepserve", version=__version__, lifespan=_lifespan(ctx, drain_timeout_s),
                  description="OpenAI-compatible API of the deepserve inference engine")
    app.state.ctx = ctx
    install_error_handlers(app)
    completions, chat, tokens = CompletionsEndpoint(ctx), ChatEndpoint(ctx), TokenizationEndpoints(ctx)
    post_generation = {"methods": ["POST"], "responses": {**_ERRORS, 200: _STREAM}}
    app.add_api_route("/v1/completions", completions.create, response_model=CompletionResponse, **post_generation)
    app.add_api_route("/v1/chat/completions", chat.create, response_model=ChatCompletionResponse,
                      **post_generation)
    app.add_api_route("/v1/models", _list_models(ctx), methods=["GET"], response_model=ModelList)
    app.add_api_route("/tokenize", tokens.tokenize, methods=["POST"], response_model=TokenizeResponse,
                      responses=_ERRORS)
    app.add_api_route("/detokenize", tokens.detokenize, methods=["POST"], response_model=DetokenizeResponse,
                      responses=_ERRORS)
    app.add_api_route("/health", _health(ctx), methods=["GET"], response_class=Response, responses=_HEALTH)
    app.add_api_route("/metrics", _metrics(ctx), methods=["GET"], response_class=Response, responses=_METRICS)
    app.add_api_route("/version", _version, methods=["GET"], response_model=VersionResponse)
    _bound_token_ids_in_schema(app, ctx.engine.engine.vocab_size)
    config = ctx.config
    limiter = RateLimiter(config.rate_limit) if config.rate_limit is not None else None
    # Added last = runs first.
    app.add_middleware(AccessGuard, api_keys=config.api_keys, rate_limiter=limiter)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    if config.allowed_origins:
        # Retry-After exposed: a page that was rate limited can read when to come back.
        app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins,
                           allow_methods=config.allowed_methods, allow_headers=config.allowed_headers,
                           allow_credentials=config.allow_credentials, expose_headers=["Retry-After"])
    app.add_middleware(RefusalCounter, count=ctx.metrics.count_rejected)
    return app


def _bound_token_ids_in_schema(app: FastAPI, vocab_size: int) -> None:
    """Serve the schema with each token id's `maximum`, known only from the loaded model's vocabulary."""
    build_schema = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            bound_token_ids(build_schema(), vocab_size)    # FastAPI caches the schema in app.openapi_schema
        return app.openapi_schema
    app.openapi = openapi     # type: ignore[method-assign]


def _lifespan(ctx: ServerContext, drain_timeout_s: float | None):
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await ctx.engine.shutdown(drain=True, timeout=drain_timeout_s)
    return lifespan


def _list_models(ctx: ServerContext):
    async def list_models() -> ModelList:
        cards = [ModelCard(id=name, created=ctx.created, root=ctx.model_path, max_model_len=ctx.max_model_len)
                 for name in ctx.model_names]
        return ModelList(data=cards)
    return list_models


def _health(ctx: ServerContext):
    async def health() -> Response:
        if ctx.engine.is_accepting:
            return Response(status_code=200)
        return error_response(OpenAIError(503, "the engine is not running", code="unavailable"))
    return health


def _metrics(ctx: ServerContext):
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)
    return metrics


async def _version() -> VersionResponse:
    return VersionResponse(version=__version__)
