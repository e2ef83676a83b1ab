"""Two real `deepserve serve` replicas of the default model (CPU) behind the router: the official `openai`
client works through it unchanged (plain and streamed), cache-aware routing keeps a shared prefix on one
replica (whose prefix cache then hits), and a replica killed under load loses no request.

About 15 s on 2 idle cores (two model loads in parallel), so it runs by default."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from router_harness import free_port, thread_router, wait_until

from deepserve.router.proxy import REPLICA_HEADER

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = ("You are a concise assistant for a bicycle repair shop. You answer questions about tyres, brakes, "
          "chains and gears in one short sentence, and you never make up prices. ")


class ServeProcess:
    def __init__(self, log_path: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")  # noqa: SIM115 - written by the server until stop()
        env = {k: v for k, v in os.environ.items() if k != "DEEPSERVE_API_KEY"}
        self.proc = subprocess.Popen([sys.executable, "-m", "deepserve.cli", "serve", "--port", str(self.port),
                                      "--max-model-len", "256", "--seed", "0"],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def ready(self) -> bool:
        assert self.proc.poll() is None, f"the server exited: {open(self.log.name).read()[-2000:]}"
        try:
            return httpx.get(self.url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def metric(self, name: str) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("replicas")
    procs = [ServeProcess(str(logs / f"replica{i}.log")) for i in range(2)]
    try:
        for proc in procs:
            wait_until(proc.ready, 240, 0.25, what=f"{proc.url} up")
        yield procs
    finally:
        for proc in procs:
            proc.stop()


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
