"""Server-sent events cut out of a byte stream at event boundaries.

The router forwards a replica's stream event by event, as each arrives (never the whole answer), and never
half an event: if the replica dies mid-event, what the client got so far is whole events, and the router's
error event that follows parses.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

_EVENT_END = re.compile(rb"\r?\n\r?\n")
DONE_EVENT = b"data: [DONE]"


class TruncatedStream(Exception):
    """The replica's stream ended in the middle of an event, or without its final `data: [DONE]`."""


class SseFramer:
    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[bytes]:
        """The events completed by `data`, each with its terminating blank line."""
        self._pending += data
        events = []
        start = 0
        for end in _EVENT_END.finditer(self._pending):
            events.append(self._pending[start:end.end()])
            start = end.end()
        self._pending = self._pending[start:]
        return events

    @property
    def pending(self) -> bytes:
        return self._pending


def is_done(event: bytes) -> bool:
    return event.strip() == DONE_EVENT


async def sse_events(raw: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Whole events of `raw`; TruncatedStream if it ends inside one or before `data: [DONE]`."""
    framer = SseFramer()
    done = False
    async for data in raw:
        for event in framer.feed(data):
            done = done or is_done(event)
            yield event
    if framer.pending.strip() or not done:
        raise TruncatedStream("the replica's stream ended before data: [DONE]")
