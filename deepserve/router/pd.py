"""Prefill/decode disaggregation, the router's half: a prefill replica computes a prompt's KV into the shared KV
store, then the decode replica the policy picks serves the request, loading that KV instead of computing it.

    client -> router -> prefill replica (the request with max_tokens 1, not streamed; `serve --role prefill`
                        answers only once the store holds the prompt's blocks)
                     -> decode replica  (the request as sent; its admission loads the blocks: cached tokens)

A prefill that fails (the replica gone, an error, a timeout) costs time, never the request: the decode replica then
computes the prompt itself. Prefill replicas are tried in turn (round robin, the next one on a failure).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

import httpx

logger = logging.getLogger(__name__)


class PrefillStage:
    def __init__(self, urls: list[str], client: httpx.AsyncClient, timeout_s: float) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.client = client
        self.timeout_s = timeout_s
        self.succeeded = 0
        self.failed = 0             # requests no prefill replica prefilled (their decode replica computed them)
        self._next = 0

    async def prefill(self, path: str, body: bytes, headers: Mapping[str, str]) -> str | None:
        """Have a prefill replica compute the request's prompt into the store; the replica's URL, or None."""
        request = prefill_body(body)
        if request is None:
            return None             # not a JSON object: the decode replica answers it (with its error)
        headers = {k: v for k, v in headers.items() if k.lower() != "content-length"}
        for attempt in range(len(self.urls)):
            url = self.urls[(self._next + attempt) % len(self.urls)]
            try:
                answer = await self.client.post(url + path, content=request, headers=headers, timeout=self.timeout_s)
            except httpx.HTTPError as e:
                logger.warning("prefill replica %s failed (%s); trying the next", url, type(e).__name__)
                continue
            if answer.status_code == 200:
                self._next = (self._next + attempt + 1) % len(self.urls)
                self.succeeded += 1
                return url
            logger.warning("prefill replica %s answered %d", url, answer.status_code)
            if answer.status_code < 500:
                break               # the request itself is refused: another prefill replica would refuse it too
        self.failed += 1
        return None


def prefill_body(body: bytes) -> bytes | None:
    """The request as a prefill: one token, one choice, not streamed (everything else, the prompt above all, kept)."""
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    request.pop("max_completion_tokens", None)
    request.pop("stream_options", None)
    request.update(max_tokens=1, stream=False, n=1)
    return json.dumps(request).encode()
