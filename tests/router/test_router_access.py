"""Keys and rate limits at the router behave as the server's: the same AccessGuard code answers, so the refusals
are the same bytes as those of a server configured the same way."""

from __future__ import annotations

import httpx
import pytest
from router_harness import fake_replicas, thread_router
from starlette.applications import Starlette
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from deepserve.serving.openai.auth import AccessGuard
from deepserve.serving.openai.rate_limit import RateLimiter

KEY = "sk-router-test"
BODY = {"model": "fake", "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def replica():
    with fake_replicas(1) as replicas:
        yield replicas[0]


def server_guard(rate_limit: float | None = None) -> TestClient:
    """What the server's middleware answers, on an app that accepts everything it lets through."""
    async def ok(_):
        return Response("ok")
    app = Starlette(routes=[Route("/v1/completions", ok, methods=["POST"])])
    guarded = AccessGuard(app, api_keys=[KEY], rate_limiter=RateLimiter(rate_limit) if rate_limit else None)
    return TestClient(guarded, base_url="http://server")


def refusal(response: httpx.Response) -> tuple[int, dict, str | None, str | None]:
    return (response.status_code, response.json(), response.headers.get("www-authenticate"),
            response.headers.get("retry-after"))


def test_keys_are_checked_like_the_server_does(replica):
    with thread_router([replica.url], api_keys=[KEY]) as router, server_guard() as server:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": "Basic abc"}):
            ours = httpx.post(router.base_url + "/v1/completions", json=BODY, headers=headers, timeout=10)
            theirs = server_post(server, headers)
            assert refusal(ours) == refusal(theirs), headers
            assert ours.status_code == 401
        good = httpx.post(router.base_url + "/v1/completions", json=BODY, headers={"Authorization": f"Bearer {KEY}"},
                          timeout=10)
        assert good.status_code == 200
        assert replica.seen()["authorization"][-1] == f"Bearer {KEY}"      # passed on to the replica
        assert replica.seen()["requests"] == 1                              # the refused ones never got there
        assert httpx.get(router.base_url + "/health", timeout=5).status_code == 200      # open, as on the server
        assert httpx.get(router.base_url + "/metrics", timeout=5).status_code == 200


def test_rate_limit_is_the_servers(replica):
    headers = {"Authorization": f"Bearer {KEY}"}
    with thread_router([replica.url], api_keys=[KEY], rate_limit=2.0) as router, server_guard(2.0) as server:
        ours = [httpx.post(router.base_url + "/v1/completions", json=BODY, headers=headers, timeout=10)
                for _ in range(3)]
        theirs = [server_post(server, headers) for _ in range(3)]
        assert [r.status_code for r in ours] == [r.status_code for r in theirs] == [200, 200, 429]
        # The message names the wait to the millisecond, which differs between two runs: compare the rest.
        for response in (ours[2], theirs[2]):
            error = response.json()["error"]
            assert (error["type"], error["code"], response.headers["retry-after"]) == (
                "rate_limit_error", "rate_limit_exceeded", "1")


def server_post(client: TestClient, headers: dict) -> httpx.Response:
    return client.post("/v1/completions", json=BODY, headers=headers)
