"""Count every refused HTTP request, by status, whichever layer refused it.

The refusals come from several places (the body limit: 413; the key check and rate limit: 401, 429; request
validation and the endpoints: 400, 404; a full queue: 503), so this middleware sits outside all of them and
reads the status each response starts with, rather than every layer counting for itself.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

# 499 is the server's own note that the client left (nothing was refused); a 503 from /health is its answer
# to a probe ("not ready"), not a request turned away.
_NOT_REFUSALS = frozenset({499})
_UNCOUNTED_PATHS = frozenset({"/health"})


def is_refusal(status: int) -> bool:
    return (400 <= status < 500 and status not in _NOT_REFUSALS) or status == 503


class RefusalCounter:
    def __init__(self, app: ASGIApp, count: Callable[[int], None]) -> None:
        self.app = app
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _UNCOUNTED_PATHS:
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start" and is_refusal(message["status"]):
                self.count(message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
