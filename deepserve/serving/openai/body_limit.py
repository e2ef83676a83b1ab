"""Refuse request bodies larger than a limit with 413, before they are buffered in full.

A declared Content-Length over the limit is refused at once. A body without one (chunked) is counted as
it is read; crossing the limit raises an OpenAIError(413) from `receive`, which the framework passes
through its body parsing (it is an HTTPException) to the error handlers.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deepserve.serving.openai.errors import OpenAIError, error_response


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await error_response(self._too_large(declared))(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large(None)
            return message

        await self.app(scope, counting_receive, send)

    def _too_large(self, size: int | None) -> OpenAIError:
        what = f"{size} bytes" if size is not None else "more bytes"
        return OpenAIError(413, f"the request body has {what}; the limit is {self.max_bytes} bytes",
                           code="request_too_large")


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
