"""Streaming plumbing: SSE framing, text deltas that never leak a stop string, and client-disconnect handling.

Engine outputs are cumulative; a `DeltaTracker` per choice remembers how much was sent and returns only
the new part. While a choice is unfinished, it holds back the longest tail of the text that is the start
of a stop string (or of another marker, e.g. `<tool_call>`), because the engine cuts a matched stop string
from the final text: what was sent must always stay a prefix of the final text.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import suppress
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def partial_marker_len(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a prefix of one of `markers` (0 if none)."""
    longest = 0
    for marker in markers:
        for k in range(min(len(marker), len(text)), longest, -1):
            if text.endswith(marker[:k]):
                longest = k
                break
    return longest


class DeltaTracker:
    """What of one choice's cumulative text and tokens has been sent."""

    def __init__(self, holdback_markers: Sequence[str] = ()) -> None:
        self.holdback_markers = [m for m in holdback_markers if m]
        self.sent_chars = 0
        self.sent_tokens = 0

    def text_delta(self, text: str, finished: bool) -> str:
        end = len(text) if finished else len(text) - partial_marker_len(text, self.holdback_markers)
        if end <= self.sent_chars:
            return ""
        delta = text[self.sent_chars:end]
        self.sent_chars = end
        return delta

    def new_tokens(self, num_tokens: int) -> range:
        """Indices of the tokens not sent yet (for their logprobs)."""
        fresh = range(self.sent_tokens, num_tokens)
        self.sent_tokens = max(self.sent_tokens, num_tokens)
        return fresh


class EventStreamResponse(Response):
    """A `text/event-stream` response that stops as soon as the client disconnects.

    Stopping cancels the iteration, which closes `events`; generators built on AsyncLLMEngine streams
    then abort their requests, freeing the KV blocks. (Starlette only watches for disconnects on some
    ASGI versions; this watches on all of them, including while a request waits to be scheduled.)
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        # No Response.__init__: it would declare a Content-Length, and a stream has none.
        self.status_code = 200
        self.background = None
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            (b"x-accel-buffering", b"no")]
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await first_completed(self._send_all(send), wait_for_disconnect(receive))
        except ClientDisconnected:
            pass    # nobody to answer; closing `events` below is what matters
        finally:
            with suppress(Exception):
                await self.events.aclose()     # type: ignore[attr-defined]

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class ClientDisconnected(Exception):
    """The client went away before the answer was ready."""


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the ASGI server reports `http.disconnect` (call after the body has been read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def first_completed(main: Awaitable[T], watcher: Awaitable[Any]) -> T:
    """Run both; return `main`'s result, or raise ClientDisconnected if `watcher` ends first. The loser is
    cancelled and awaited, so its cleanup (closing streams, aborting requests) has run on return."""
    main_task = asyncio.ensure_future(main)
    watch_task = asyncio.ensure_future(watcher)
    try:
        await asyncio.wait({main_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (main_task, watch_task):
            if not task.done():
                task.cancel()
        await asyncio.gather(main_task, watch_task, return_exceptions=True)
    if main_task.cancelled():
        raise ClientDisconnected()
    return main_task.result()


async def merge_streams(streams: Sequence[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as (index, item) in arrival order; close all of them at the end."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    arrivals: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    finished = object()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                arrivals.put_nowait((index, item))
        except Exception as error:  # noqa: BLE001 - handed to the consumer, which re-raises it
            arrivals.put_nowait((index, error))
        finally:
            arrivals.put_nowait((index, finished))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await arrivals.get()
            if item is finished:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
