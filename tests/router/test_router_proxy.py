"""The router in front of fake replica processes: passthrough (plain and streamed, unbuffered), retries
(bounded), failover (a killed replica out and back, a hung one bypassed), mid-stream failures, circuit breaking,
load accounting."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from router_harness import fake_replicas, read_stream, thread_router, wait_until

from deepserve.router.proxy import REPLICA_HEADER

BODY = {"model": "fake", "prompt": "hello there", "max_tokens": 4}
STREAM = {**BODY, "stream": True}


@pytest.fixture(scope="module")
def two():
    with fake_replicas(2) as replicas:
        yield replicas


@pytest.fixture(autouse=True)
def reset(two):
    for replica in two:
        if replica.proc.poll() is not None:
            replica.restart()
        replica.resume()
        replica.control(reset=True)


def post(router, body, **kw) -> httpx.Response:
    return httpx.post(router.base_url + "/v1/completions", json=body, timeout=kw.pop("timeout", 20), **kw)


def all_released(router) -> bool:
    return all(r.in_flight == 0 and r.in_flight_tokens == 0 for r in router.state.replicas)


def test_plain_request_passes_through(two):
    with thread_router([two[0].url]) as router:
        response = post(router, BODY)
        assert response.status_code == 200
        assert response.json()["choices"][0]["text"] == "c0c1c2"
        assert response.headers[REPLICA_HEADER] == two[0].url
        assert two[0].seen()["prompts"] == ["hello there"]
        models = httpx.get(router.base_url + "/v1/models", timeout=10)
        assert models.json()["data"][0]["id"] == "fake"
        assert all_released(router)


def test_stream_is_forwarded_chunk_by_chunk_not_buffered(two):
    two[0].control(num_chunks=3, chunk_delay_s=0.8)
    with thread_router([two[0].url]) as router:
        start = time.monotonic()
        with httpx.stream("POST", router.base_url + "/v1/completions", json=STREAM, timeout=20) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            events, times = read_stream(response)
        assert [e["choices"][0]["text"] for e in events[:-1]] == ["c0", "c1", "c2"] and events[-1] == "[DONE]"
        # The first chunk reached the client ~1.6 s before the replica sent its last one.
        assert times[0] - start < 0.6, times
        assert times[2] - times[0] > 1.4, times
        assert all_released(router)


def test_client_error_passes_through_without_retry(two):
    two[0].control(status=400)
    with thread_router([two[0].url, two[1].url], policy="round_robin") as router:
        response = post(router, BODY)
        if response.status_code == 200:            # round robin started on the other one: once more
            response = post(router, BODY)
        assert response.status_code == 400 and response.json()["error"]["message"] == f"fake-{two[0].port} fails"
        assert router.metric("deepserve:router_retries_total") == 0
        assert two[0].seen()["requests"] == 1


def test_5xx_is_retried_on_another_replica(two):
    two[0].control(status=503)
    with thread_router([two[0].url, two[1].url], policy="round_robin") as router:
        responses = [post(router, BODY) for _ in range(4)]
        assert all(r.status_code == 200 and r.headers[REPLICA_HEADER] == two[1].url for r in responses)
        failed_there = two[0].seen()["requests"]
        assert failed_there >= 1                       # round robin does send first attempts there
        assert router.metric("deepserve:router_retries_total") == failed_there       # each one retried once
        assert router.metric("deepserve:router_replica_errors_total", replica=two[0].url,
                             kind="status_5xx") == failed_there
        assert all_released(router)


def test_retries_are_bounded(two):
    for replica in two:
        replica.control(status=500)
    with thread_router([two[0].url, two[1].url], max_retries=3, breaker_failures=100) as router:
        response = post(router, BODY)
        assert response.status_code == 500            # the replica's own error, passed on
        attempts = sum(r.seen()["requests"] for r in two)
        assert attempts == 4                           # 1 + max_retries
        assert router.metric("deepserve:router_retries_total") == 3
        assert router.metric("deepserve:router_requests_failed_total", reason="retries_exhausted") == 1


def test_stream_failing_before_its_first_event_is_retried(two):
    two[0].control(fail_after_chunks=0)
    with thread_router([two[0].url, two[1].url], policy="round_robin") as router:
        for _ in range(2):                             # one of the two starts on the failing replica
            with httpx.stream("POST", router.base_url + "/v1/completions", json=STREAM, timeout=20) as response:
                events, _ = read_stream(response)
                assert response.headers[REPLICA_HEADER] == two[1].url
            assert [e["choices"][0]["text"] for e in events[:-1]] == ["c0", "c1", "c2"]
        failed_there = two[0].seen()["requests"]
        assert failed_there >= 1 and router.metric("deepserve:router_retries_total") == failed_there


def test_stream_failing_after_it_started_ends_with_an_error_event(two):
    two[0].control(fail_after_chunks=1, chunk_delay_s=0.05)
    with thread_router([two[0].url]) as router:
        with httpx.stream("POST", router.base_url + "/v1/completions", json=STREAM, timeout=20) as response:
            assert response.status_code == 200
            events, _ = read_stream(response)
        assert events[0]["choices"][0]["text"] == "c0"
        assert events[1]["error"]["code"] == "replica_failed" and events[1]["error"]["type"] == "server_error"
        assert events[2] == "[DONE]" and len(events) == 3
        assert router.metric("deepserve:router_retries_total") == 0      # part of an answer was sent: no retry
        assert router.metric("deepserve:router_requests_failed_total", reason="mid_stream") == 1
        assert all_released(router)


def test_client_leaving_a_stream_closes_it_on_the_replica(two):
    two[0].control(num_chunks=50, chunk_delay_s=0.1)
    with thread_router([two[0].url]) as router:
        with httpx.stream("POST", router.base_url + "/v1/completions", json=STREAM, timeout=20) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
        wait_until(lambda: two[0].seen()["streams_cut_by_client"] == 1, 5, what="replica saw the client leave")
        wait_until(lambda: all_released(router), 5, what="load released")
        assert two[0].seen()["streams_finished"] == 0


def test_killed_replica_is_taken_out_then_probed_back(two):
    with thread_router([two[0].url, two[1].url], policy="round_robin") as router:
        wait_until(lambda: len(router.state.replicas.eligible()) == 2, what="both eligible")
        two[0].kill()
        responses = [post(router, BODY) for _ in range(6)]
        assert all(r.status_code == 200 and r.headers[REPLICA_HEADER] == two[1].url for r in responses)
        assert not router.replica(two[0].url).healthy
        assert router.metric("deepserve:router_replica_healthy", replica=two[0].url) == 0
        two[0].restart()
        wait_until(lambda: router.replica(two[0].url).is_eligible(), 5, what="killed replica back")
        served_by = {post(router, BODY).headers[REPLICA_HEADER] for _ in range(4)}
        assert served_by == {two[0].url, two[1].url}
        assert all_released(router)


def test_hung_replica_is_found_and_its_requests_retried(two):
    # A request in flight on a replica that hangs (SIGSTOP) is cut when the probes take it out, and retried.
    with thread_router([two[0].url, two[1].url], policy="round_robin", read_timeout_s=30.0) as router:
        wait_until(lambda: len(router.state.replicas.eligible()) == 2, what="both eligible")
        two[0].pause()
        start = time.monotonic()
        responses = [post(router, BODY) for _ in range(2)]     # round robin: one of them starts on the hung one
        elapsed = time.monotonic() - start
        assert all(r.status_code == 200 and r.headers[REPLICA_HEADER] == two[1].url for r in responses)
        assert elapsed < 5, f"took {elapsed:.1f} s: the hang was waited out, not detected"
        assert not router.replica(two[0].url).healthy
        assert router.metric("deepserve:router_replica_errors_total", replica=two[0].url, kind="taken_out") == 1
        two[0].resume()
        wait_until(lambda: router.replica(two[0].url).is_eligible(), 5, what="resumed replica back")


def test_circuit_opens_on_a_failing_replica_that_passes_its_probes(two):
    two[0].control(status=500)
    with thread_router([two[0].url, two[1].url], policy="round_robin", breaker_failures=2,
                       breaker_cooldown_s=60.0) as router:
        for _ in range(8):
            assert post(router, BODY).status_code == 200
        assert two[0].seen()["requests"] == 2          # then the circuit opened: no more traffic there
        assert router.replica(two[0].url).healthy and router.replica(two[0].url).breaker.state == "open"
        assert router.metric("deepserve:router_replica_circuit_state", replica=two[0].url, state="open") == 1


def test_circuit_half_opens_and_a_good_trial_closes_it(two):
    two[0].control(status=500)
    with thread_router([two[0].url, two[1].url], policy="round_robin", breaker_failures=1,
                       breaker_cooldown_s=0.3) as router:
        for _ in range(3):
            post(router, BODY)
        assert router.replica(two[0].url).breaker.state != "closed"
        two[0].control(status=200)
        time.sleep(0.35)
        served_by = {post(router, BODY).headers[REPLICA_HEADER] for _ in range(4)}
        assert two[0].url in served_by and router.replica(two[0].url).breaker.state == "closed"


def test_a_stream_its_client_closes_at_done_is_a_success(two):
    # Clients (the benchmark's among them) hang up as soon as they read [DONE], here while the replica's stream
    # is still open. The stream was whole: counted ok, and as a half-open breaker's trial it closes the circuit
    # (it used to be counted as nothing, leaving the trial in flight for good and the replica out for good).
    two[0].control(status=500)
    with thread_router([two[0].url], breaker_failures=1, breaker_cooldown_s=0.3, max_retries=0) as router:
        assert post(router, BODY).status_code == 500
        assert router.replica(two[0].url).breaker.state == "open"
        two[0].control(status=200, done_linger_s=2.0)
        time.sleep(0.35)
        with httpx.stream("POST", router.base_url + "/v1/completions", json=STREAM, timeout=20) as response:
            lines = []
            for line in response.iter_lines():
                lines.append(line)
                if line == "data: [DONE]":
                    break
        assert len(lines) > 1 and router.replica(two[0].url).breaker.state == "closed"
        assert router.metric("deepserve:router_requests_total", replica=two[0].url, outcome="ok") == 1
        wait_until(lambda: all_released(router), 5, what="the dispatch released")


def test_no_eligible_replica_is_a_503_after_the_wait(two):
    two[0].control(health_status=503)
    with thread_router([two[0].url], wait_for_replica_s=0.5) as router:
        start = time.monotonic()
        response = post(router, BODY)
        assert response.status_code == 503 and response.json()["error"]["code"] == "no_replica"
        assert 0.4 < time.monotonic() - start < 3
        assert httpx.get(router.base_url + "/health", timeout=5).status_code == 503
        assert router.metric("deepserve:router_requests_failed_total", reason="no_replica") == 1


def test_a_request_waits_for_a_replica_coming_up(two):
    two[0].control(health_status=503)
    with thread_router([two[0].url], wait_for_replica_s=5.0) as router:
        with httpx.Client(timeout=20) as client:
            threading.Timer(0.5, lambda: two[0].control(health_status=200)).start()
            response = client.post(router.base_url + "/v1/completions", json=BODY)
        assert response.status_code == 200


def test_load_reports_are_read_and_steer_least_load(two):
    two[0].control(running=10, waiting=5)
    with thread_router([two[0].url, two[1].url], policy="least_load") as router:
        wait_until(lambda: router.replica(two[0].url).load == 15, 5, what="load report read")
        served_by = {post(router, BODY).headers[REPLICA_HEADER] for _ in range(4)}
        assert served_by == {two[1].url}
        assert router.metric("deepserve:router_replica_load", replica=two[0].url) == 15
