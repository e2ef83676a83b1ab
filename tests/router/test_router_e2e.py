"""Two real `deepserve serve` replicas of the default model (CPU) behind the router: the official `openai`
client works through it unchanged (plain and streamed), cache-aware routing keeps a shared prefix on one
replica (whose prefix cache then hits), a replica that hangs (SIGSTOP) is found and bypassed and rejoins after
SIGCONT, and a replica killed under load loses no request.

About 20 s on 2 idle cores (two model loads in parallel, the hang's detection; ~35 s beside 3 busy processes),
so it runs by default."""

from __future__ import annotations

import concurrent.futures
import signal
import time

import httpx
import openai
import pytest
from router_harness import MODEL, serve_processes, thread_router, wait_until

from deepserve.router.proxy import REPLICA_HEADER

SYSTEM = ("You are a concise assistant for a bicycle repair shop. You answer questions about tyres, brakes, "
          "chains and gears in one short sentence, and you never make up prices. ")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    # One thread each: two replicas of 2 threads on 2 cores spin against each other, 3x slower when the VM is busy.
    with serve_processes(tmp_path_factory.mktemp("replicas"), 2, threads=1) as procs:
        yield procs


@pytest.fixture(scope="module")
def router(servers):
    with thread_router([s.url for s in servers], policy="cache_aware", health_interval_s=0.2,
                       health_timeout_s=2.0, read_timeout_s=120.0) as r:
        wait_until(lambda: len(r.state.replicas.eligible()) == 2, 10, what="both replicas eligible")
        yield r


def test_openai_client_through_the_router(router):
    with openai.OpenAI(base_url=router.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi"}],
                                              max_tokens=5, temperature=0)
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
        stream = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                           temperature=0, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text and chunks[-1].usage.completion_tokens == 6
        plain = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                          temperature=0)
        assert plain.choices[0].text == text           # greedy: streamed or not, the same tokens
        assert [m.id for m in client.models.list().data] == [MODEL]


def test_cache_aware_keeps_a_shared_prefix_on_one_replica(router, servers):
    hits_before = {s.url: s.metric("deepserve:prefix_cache_hits_total") for s in servers}
    served_by = []
    with httpx.Client(base_url=router.base_url, timeout=60) as client:
        for i in range(3):
            body = {"model": MODEL, "max_tokens": 2, "temperature": 0,
                    "messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": f"Question {i}: how often should I oil a chain?"}]}
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            served_by.append(response.headers[REPLICA_HEADER])
    assert len(set(served_by)) == 1, served_by
    hot = next(s for s in servers if s.url == served_by[0])
    assert hot.metric("deepserve:prefix_cache_hits_total") - hits_before[hot.url] >= 2 * 32   # the system prompt, twice
    assert router.metric("deepserve:router_routing_decisions_total", policy="cache_aware", reason="cache_hit") >= 2


def test_a_hung_replica_is_bypassed_and_rejoins_after_sigcont(servers):
    # A router of its own (round robin): every other request is sent to the hung replica while it is still
    # listed, so the test sees both the cut request and the later ones steered around it.
    def one(client: httpx.Client, i: int) -> httpx.Response:
        body = {"model": MODEL, "prompt": f"Story {i}: once upon a time", "max_tokens": 12, "temperature": 0}
        return client.post("/v1/completions", json=body)

    with thread_router([s.url for s in servers], policy="round_robin", health_interval_s=0.2, health_timeout_s=2.0,
                       read_timeout_s=120.0) as router, httpx.Client(base_url=router.base_url, timeout=120) as client, \
            concurrent.futures.ThreadPoolExecutor(4) as pool:
        wait_until(lambda: len(router.state.replicas.eligible()) == 2, 10, what="both replicas eligible")
        first = pool.submit(one, client, 0)
        victim = wait_until(lambda: next((s for s in servers if router.replica(s.url).in_flight), None), 30, 0.01,
                            what="the first request in flight")
        victim.proc.send_signal(signal.SIGSTOP)
        try:
            start = time.monotonic()
            later = [pool.submit(one, client, i) for i in range(1, 4)]
            responses = [f.result(timeout=120) for f in (first, *later)]
            elapsed = time.monotonic() - start
            assert [r.status_code for r in responses] == [200] * 4, [r.text[:200] for r in responses]
            assert {r.headers[REPLICA_HEADER] for r in responses} == {next(s.url for s in servers if s is not victim)}
            # Found by the probes (2 x 2 s timeouts), not by the 120 s read timeout of the request it held.
            assert elapsed < 40, f"took {elapsed:.1f} s: the hang was waited out, not detected"
            assert not router.replica(victim.url).healthy
            assert router.metric("deepserve:router_replica_errors_total", replica=victim.url, kind="taken_out") >= 1
            assert router.metric("deepserve:router_retries_total") >= 1
        finally:
            victim.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: router.replica(victim.url).is_eligible(), 20, 0.05, what="the resumed replica back")
        served_by = {one(client, i).headers[REPLICA_HEADER] for i in range(4, 6)}
        assert served_by == {s.url for s in servers}


def test_a_replica_killed_under_load_loses_no_request(router, servers):
    def one(i: int) -> tuple[int, str]:
        body = {"model": MODEL, "prompt": f"Request {i}: count to ten", "max_tokens": 8, "temperature": 0}
        with httpx.Client(timeout=120) as client:
            response = client.post(router.base_url + "/v1/completions", json=body)
        return response.status_code, response.headers.get(REPLICA_HEADER, "")

    def busy_server():
        return next((s for s in servers if router.replica(s.url).in_flight > 1), None)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(8)]
        victim = wait_until(busy_server, 30, 0.01, what="requests in flight on a replica")
        victim.proc.kill()
        results = [f.result(timeout=180) for f in futures]
    assert [status for status, _ in results] == [200] * 8      # retried on the survivor, none lost
    assert not router.replica(victim.url).healthy
    assert httpx.get(router.base_url + "/health", timeout=5).status_code == 200
