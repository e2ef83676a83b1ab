"""`deepserve router` as a process: the replicas file is re-read on SIGHUP and when it changes; SIGTERM stops it."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

import httpx
import pytest
from router_harness import fake_replicas, free_port, thread_router, wait_until

from deepserve.router.proxy import REPLICA_HEADER

BODY = {"model": "fake", "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def two():
    with fake_replicas(2) as replicas:
        yield replicas


def served_by(base_url: str, n: int = 4) -> set[str]:
    return {httpx.post(base_url + "/v1/completions", json=BODY, timeout=10).headers[REPLICA_HEADER]
            for _ in range(n)}


def eligible_urls(base_url: str) -> set[str]:
    replicas = httpx.get(base_url + "/router/replicas", timeout=5).json()["replicas"]
    return {r["url"] for r in replicas if r["eligible"]}


def test_sighup_rereads_the_replicas_file(two, tmp_path):
    path = tmp_path / "replicas"
    path.write_text(two[0].url + "\n")
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    # Probes every 60 s: only the signal (and the probe it starts for a new replica) can bring B in quickly.
    proc = subprocess.Popen([sys.executable, "-m", "deepserve.cli", "router", "--replicas-file", str(path),
                             "--port", str(port), "--policy", "round_robin", "--health-interval", "60"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_until(lambda: _healthy(base_url), 30, what="router up")
        assert served_by(base_url) == {two[0].url}
        path.write_text(f"{two[0].url}\n{two[1].url}\n")
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: eligible_urls(base_url) == {two[0].url, two[1].url}, 5, what="B added on SIGHUP")
        assert served_by(base_url) == {two[0].url, two[1].url}
        path.write_text(two[1].url + "\n")
        proc.send_signal(signal.SIGHUP)
        wait_until(lambda: eligible_urls(base_url) == {two[1].url}, 5, what="A removed on SIGHUP")
        assert served_by(base_url) == {two[1].url}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
    assert proc.returncode == 0, output


def test_a_changed_replicas_file_is_picked_up_without_a_signal(two, tmp_path):
    path = tmp_path / "replicas"
    path.write_text(two[0].url + "\n")
    with thread_router([], replicas_file=str(path), policy="round_robin") as router:
        wait_until(lambda: eligible_urls(router.base_url) == {two[0].url}, 5, what="A up")
        path.write_text(f"{two[1].url}\n")
        wait_until(lambda: eligible_urls(router.base_url) == {two[1].url}, 5, what="file change seen")
        assert served_by(router.base_url) == {two[1].url}


def test_a_removed_replica_is_listed_until_its_last_request_ends(two, tmp_path):
    # The local cluster's supervisor stops a drained engine once the router lists it neither as a member nor as
    # removed with requests in flight; a removed replica that vanished from the list at once would be stopped
    # under its requests.
    path = tmp_path / "replicas"
    path.write_text(f"{two[0].url}\n{two[1].url}\n")
    for replica in two:
        replica.control(delay_s=1.5)
    try:
        with thread_router([], replicas_file=str(path), policy="round_robin") as router:
            wait_until(lambda: len(eligible_urls(router.base_url)) == 2, 5, what="both up")
            slow = threading.Thread(target=served_by, args=(router.base_url, 1))
            slow.start()
            busy = wait_until(lambda: next((r for r in two if router.replica(r.url).in_flight), None), 5, 0.01,
                              what="a request in flight")
            other = next(r for r in two if r is not busy)
            path.write_text(f"{other.url}\n")
            wait_until(lambda: eligible_urls(router.base_url) == {other.url}, 5, what="the busy one removed")
            replicas = httpx.get(router.base_url + "/router/replicas", timeout=5).json()["replicas"]
            listed = {r["url"]: r for r in replicas}
            assert listed[busy.url]["removed"] and listed[busy.url]["in_flight"] == 1
            assert not listed[other.url]["removed"]
            slow.join(10)
            listed = [r["url"] for r in httpx.get(router.base_url + "/router/replicas", timeout=5).json()["replicas"]]
            assert listed == [other.url]
    finally:
        for replica in two:
            replica.control(delay_s=0.0)


def test_router_needs_a_replica():
    result = subprocess.run([sys.executable, "-m", "deepserve.cli", "router"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "--replica" in result.stderr


def _healthy(base_url: str) -> bool:
    try:
        return httpx.get(base_url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
