"""API-key authentication and per-key rate limiting, as one ASGI middleware in front of the app.

It runs before the body is read, so a client without a valid key is refused (401) whatever it sends, and
a refused request costs no parsing. Keys are compared in constant time (hmac.compare_digest) against
every configured key, so timing reveals neither which key nor how much of it matched.
Open paths (health, metrics, version, the schema and docs) need no key and are not rate limited.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from deepserve.serving.openai.errors import OpenAIError, error_response
from deepserve.serving.openai.rate_limit import RateLimiter, retry_after_header

OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect",
                        "/redoc"})


class AccessGuard:
    def __init__(self, app: ASGIApp, api_keys: Sequence[str] = (), rate_limiter: RateLimiter | None = None) -> None:
        self.app = app
        self._keys = [key.encode() for key in api_keys]
        self.rate_limiter = rate_limiter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        error = self._check(scope)
        if error is not None:
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> OpenAIError | None:
        client = _client_address(scope)
        if self._keys:
            key = _bearer_token(scope)
            if key is None:
                return OpenAIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                                   code="missing_api_key", headers={"WWW-Authenticate": "Bearer"})
            if not self._is_valid(key):
                return OpenAIError(401, "invalid API key", code="invalid_api_key",
                                   headers={"WWW-Authenticate": "Bearer"})
            client = "key:" + key.decode("latin-1")
        if self.rate_limiter is not None:
            wait_s = self.rate_limiter.acquire(client)
            if wait_s > 0:
                return OpenAIError(429, f"rate limit of {self.rate_limiter.rate:g} requests/s exceeded; retry "
                                        f"in {wait_s:.2f} s", code="rate_limit_exceeded",
                                   headers={"Retry-After": retry_after_header(wait_s)})
        return None

    def _is_valid(self, key: bytes) -> bool:
        valid = False
        for candidate in self._keys:
            # No early exit: every key is compared, whichever matches.
            valid |= hmac.compare_digest(key, candidate)
        return valid


def _bearer_token(scope: Scope) -> bytes | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


def _client_address(scope: Scope) -> str:
    client = scope.get("client")
    return f"addr:{client[0]}" if client else "addr:unknown"
