"""Forward one request to a replica chosen by the policy; retry it elsewhere while nothing was sent back yet.

A request is "not yet streamed" until the router has sent its client a byte: for a plain request, until the
replica's whole answer is in; for a stream, until its first event is. Until then any failure (refused
connection, timeout, cut connection, a 5xx, the replica taken out by the health checker) is retried on
another replica, at most `max_retries` times, after a jittered exponential backoff. After the first event a
failure cannot be retried (the client has part of an answer): the stream ends with an OpenAI error event and
`data: [DONE]`, as the server's own streams end on an error. A 4xx is the client's (the replica checked the
body) and goes back as it is. So every request ends: with an answer, a clean error, or a 503 when no replica
became eligible within `wait_for_replica_s`.

Streams are forwarded event by event as they arrive (sse.py), never buffered; the connection to the replica
is closed when the client leaves, which aborts the request on the replica.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import httpx
from starlette.responses import Response

from deepserve.router.config import RouterConfig
from deepserve.router.metrics import RouterMetrics
from deepserve.router.policies import CacheAware, Decision, LeastLoad, Policy
from deepserve.router.replica import Dispatch, Replica, ReplicaDown
from deepserve.router.replica_set import ReplicaSet
from deepserve.router.routing_key import RoutedRequest
from deepserve.router.sse import TruncatedStream, is_done, sse_events
from deepserve.serving.openai.errors import OpenAIError, error_body, error_response
from deepserve.serving.openai.streaming import SSE_DONE, EventStreamResponse, sse_event

logger = logging.getLogger(__name__)

REPLICA_HEADER = "x-deepserve-replica"          # which replica answered (debugging, tests)
_RETRYABLE_STATUS = frozenset({500, 502, 503, 504})
_FORWARDED_REQUEST_HEADERS = ("authorization", "content-type", "accept", "x-request-id")
_FORWARDED_RESPONSE_HEADERS = ("content-type", "retry-after", "www-authenticate", "x-request-id")
_MAX_BACKOFF_S = 2.0
_WAIT_POLL_S = 0.25       # a breaker's cooldown ends without an event: waiters look again this often
_END = object()


@dataclass
class Answer:
    """A complete answer from a replica (a plain response, or the refusal of a stream)."""
    status: int
    headers: Mapping[str, str]
    body: bytes
    replica: str

    def response(self) -> Response:
        headers = {k: v for k, v in self.headers.items() if k.lower() in _FORWARDED_RESPONSE_HEADERS}
        headers[REPLICA_HEADER] = self.replica
        return Response(self.body, status_code=self.status, headers=headers)


@dataclass
class OpenStream:
    """A stream whose first event has arrived: from here on it belongs to the client."""
    dispatch: Dispatch
    response: httpx.Response
    events: AsyncIterator[bytes]
    first_event: bytes


class AttemptFailed(Exception):
    def __init__(self, kind: str, message: str, answer: Answer | None = None) -> None:
        super().__init__(message)
        self.kind = kind               # connect | timeout | protocol | status_5xx | taken_out
        self.answer = answer           # the replica's 5xx, passed on if no retry succeeds


def failure_kind(error: BaseException) -> str:
    if isinstance(error, ReplicaDown):
        return "taken_out"
    if isinstance(error, httpx.ConnectError):
        return "connect"
    if isinstance(error, httpx.TimeoutException):
        return "timeout"
    return "protocol"


class Proxy:
    def __init__(self, config: RouterConfig, replicas: ReplicaSet, policy: Policy, client: httpx.AsyncClient,
                 metrics: RouterMetrics) -> None:
        self.config = config
        self.replicas = replicas
        self.policy = policy
        self.client = client
        self.metrics = metrics
        self._any = LeastLoad()            # requests with no prefix to match (models, tokenize)
        self._random = random.Random(config.seed)

    async def forward(self, request: RoutedRequest, headers: Mapping[str, str], use_policy: bool = True) -> Response:
        tried: set[str] = set()
        last_failure: AttemptFailed | None = None
        for attempt in range(self.config.max_retries + 1):
            if attempt:
                self.metrics.retries.inc()
                await asyncio.sleep(self.backoff_s(attempt))
            decision = await self.choose(request, tried, use_policy)
            if decision is None:
                break
            tried.add(decision.replica.url)
            try:
                return await self._attempt(decision.replica, request, headers)
            except AttemptFailed as failure:
                logger.info("attempt %d of %s on %s failed: %s", attempt + 1, request.path, decision.replica.url,
                            failure)
                last_failure = failure
        return self._give_up(last_failure)

    def backoff_s(self, attempt: int) -> float:
        """Before retry `attempt` (1, 2, ...): base * 2^(attempt-1), jittered by +-50% so retries spread out."""
        base = self.config.retry_backoff_s * 2 ** (attempt - 1)
        return min(_MAX_BACKOFF_S, base * self._random.uniform(0.5, 1.5))

    async def choose(self, request: RoutedRequest, tried: set[str], use_policy: bool) -> Decision | None:
        """A replica for this attempt (an untried one if any is eligible); waits for one up to wait_for_replica_s."""
        deadline = time.monotonic() + self.config.wait_for_replica_s
        while True:
            eligible = self.replicas.eligible()
            if eligible:
                candidates = [r for r in eligible if r.url not in tried] or eligible
                return self._decide(candidates, request, use_policy)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            await self.replicas.wait_for_change(min(remaining, _WAIT_POLL_S))

    def _decide(self, candidates: list[Replica], request: RoutedRequest, use_policy: bool) -> Decision:
        if not use_policy:
            return Decision(self._any.least_loaded(candidates), "any")
        decision = self.policy.choose(candidates, request)
        self.metrics.decisions.labels(self.policy.name, decision.reason).inc()
        if isinstance(self.policy, CacheAware) and request.text:
            self.metrics.match_chars.observe(decision.matched_chars)
            self.metrics.match_ratio.observe(decision.matched_chars / len(request.text))
        return decision

    # --- one attempt -----------------------------------------------------------------------------
    async def _attempt(self, replica: Replica, request: RoutedRequest, headers: Mapping[str, str]) -> Response:
        dispatch = replica.begin(request.tokens)
        try:
            if request.stream:
                opened = await self._open_stream(replica, request, headers, dispatch)
                if isinstance(opened, OpenStream):
                    response = EventStreamResponse(self._relay(replica, opened))
                    response.raw_headers.append((REPLICA_HEADER.encode(), replica.url.encode()))
                    return response        # the relay releases the dispatch
                answer = opened
            else:
                answer = await self._exchange(replica, request, headers)
        except AttemptFailed as failure:
            dispatch.release()
            self._on_failure(replica, failure.kind)
            raise
        except BaseException:
            dispatch.release()
            raise
        dispatch.release()
        return self._on_answer(replica, answer)

    def _on_answer(self, replica: Replica, answer: Answer) -> Response:
        if answer.status in _RETRYABLE_STATUS:
            self._on_failure(replica, "status_5xx")
            raise AttemptFailed("status_5xx", f"{replica.url} answered {answer.status}", answer)
        self._on_success(replica)
        return answer.response()

    async def _exchange(self, replica: Replica, request: RoutedRequest, headers: Mapping[str, str]) -> Answer:
        upstream = self.client.build_request(request.method, replica.url + request.path,
                                             content=request.body or None, headers=headers)
        try:
            response = await replica.run(self.client.send(upstream))
        except (httpx.HTTPError, ReplicaDown) as error:
            raise AttemptFailed(failure_kind(error), describe(error)) from error
        return Answer(response.status_code, response.headers, response.content, replica.url)

    async def _open_stream(self, replica: Replica, request: RoutedRequest, headers: Mapping[str, str],
                           dispatch: Dispatch) -> OpenStream | Answer:
        """Send the request and wait for the first event (until then the request can still be retried)."""
        upstream = self.client.build_request(request.method, replica.url + request.path, content=request.body,
                                             headers=headers)
        try:
            response = await replica.run(self.client.send(upstream, stream=True))
        except (httpx.HTTPError, ReplicaDown) as error:
            raise AttemptFailed(failure_kind(error), describe(error)) from error
        try:
            if response.status_code != 200 or not is_event_stream(response):
                body = await replica.run(response.aread())
                return Answer(response.status_code, response.headers, body, replica.url)
            events = sse_events(response.aiter_raw())
            first = await replica.run(next_event(events))
            if first is _END:
                raise TruncatedStream("the replica's stream ended before its first event")
            return OpenStream(dispatch, response, events, first)
        except (httpx.HTTPError, ReplicaDown, TruncatedStream) as error:
            await response.aclose()
            raise AttemptFailed(failure_kind(error), describe(error)) from error
        except BaseException:
            await response.aclose()
            raise

    async def _relay(self, replica: Replica, stream: OpenStream) -> AsyncIterator[bytes]:
        """The stream's events as they arrive; a failure from here on ends it with an error event."""
        try:
            event = stream.first_event
            while event is not _END:
                if is_done(event):
                    # Counted before [DONE] is passed on: a client may close as soon as it reads it, which ends
                    # this generator at the yield; uncounted, a half-open breaker's trial would never finish.
                    self._on_success(replica)
                yield event
                event = await replica.run(next_event(stream.events))
        except (httpx.HTTPError, ReplicaDown, TruncatedStream) as error:
            self._on_failure(replica, "mid_stream")
            self.metrics.failed.labels("mid_stream").inc()
            logger.warning("stream from %s failed after it started: %s", replica.url, describe(error))
            yield sse_event(error_body(f"the replica serving this stream failed: {describe(error)}", "server_error",
                                       code="replica_failed"))
            yield SSE_DONE
        finally:
            stream.dispatch.release()
            await stream.response.aclose()      # unfinished: the replica sees the connection close and aborts

    # --- outcomes --------------------------------------------------------------------------------
    def _on_success(self, replica: Replica) -> None:
        replica.breaker.on_success()
        self.metrics.attempts.labels(replica.url, "ok").inc()

    def _on_failure(self, replica: Replica, kind: str) -> None:
        self.metrics.attempts.labels(replica.url, "error").inc()
        self.metrics.replica_errors.labels(replica.url, kind).inc()
        if kind == "connect":
            # Nothing listens there: out at once (the probes bring it back), no waiting for the next round.
            replica.mark_down("connection refused")
        if kind != "taken_out":
            was_eligible = replica.breaker.allows()
            replica.breaker.on_failure()
            if was_eligible and not replica.breaker.allows():
                logger.warning("circuit of %s opened after %d failures in a row", replica.url,
                               replica.breaker.consecutive_failures)

    def _give_up(self, last_failure: AttemptFailed | None) -> Response:
        if last_failure is None:
            self.metrics.failed.labels("no_replica").inc()
            return error_response(OpenAIError(503, "no healthy replica to serve the request", code="no_replica",
                                              error_type="service_unavailable", headers={"Retry-After": "1"}))
        self.metrics.failed.labels("retries_exhausted").inc()
        if last_failure.answer is not None:
            return last_failure.answer.response()        # the replica's own 5xx says most
        return error_response(OpenAIError(502, f"no replica answered: {last_failure}", code="replica_failed",
                                          error_type="server_error"))


async def next_event(events: AsyncIterator[bytes]) -> object:
    """The next event, or _END (a task cannot end by raising StopAsyncIteration cleanly)."""
    try:
        return await events.__anext__()
    except StopAsyncIteration:
        return _END


def is_event_stream(response: httpx.Response) -> bool:
    return response.headers.get("content-type", "").startswith("text/event-stream")


def describe(error: BaseException) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def forward_headers(incoming: Mapping[str, str], replica_api_key: str | None = None) -> dict[str, str]:
    headers = {k: v for k, v in incoming.items() if k.lower() in _FORWARDED_REQUEST_HEADERS}
    if replica_api_key:
        headers["authorization"] = f"Bearer {replica_api_key}"
    return headers
