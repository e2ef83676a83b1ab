"""Replicas as real processes (fake ones, or `deepserve serve` of the default model), and routers (in a thread of
the test process, or `deepserve router` as a process), all on 127.0.0.1 with free ports. Every wait is bounded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import httpx

from deepserve.router.app import build_router_app
from deepserve.router.config import RouterConfig

START_TIMEOUT_S = 30
FAKE_REPLICA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_replica.py")
# Fast failure detection for tests: probes every 0.1 s, a probe slower than 0.5 s fails, 2 failures take out.
FAST = dict(health_interval_s=0.1, health_timeout_s=0.5, unhealthy_after=2, retry_backoff_s=0.01,
            wait_for_replica_s=2.0, connect_timeout_s=1.0, read_timeout_s=30.0, seed=0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until(predicate, timeout_s: float = 10.0, interval_s: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"{what} not reached in {timeout_s} s")


@contextlib.contextmanager
def serve_cluster(log_path, *flags: str):
    """`deepserve serve` with `flags` on a free port, logging to `log_path`: (base URL, process). SIGTERM at the end
    must exit it cleanly (code 0) and leave no child process behind."""
    port = free_port()
    log = open(log_path, "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "deepserve.cli", "serve", *flags, "--port", str(port),
                             "--max-model-len", "256"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    with open(log_path) as f:
        assert proc.returncode == 0, f.read()[-3000:]
    leftover = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert not leftover


class FakeReplicaProcess:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, FAKE_REPLICA, "--port", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait_ready(self) -> None:
        def up() -> bool:
            assert self.proc is not None and self.proc.poll() is None, "the fake replica exited"
            try:
                return httpx.get(self.url + "/control", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(up, START_TIMEOUT_S, what=f"fake replica {self.url} up")

    def control(self, **changes) -> dict:
        return httpx.post(self.url + "/control", json=changes, timeout=5).json()

    def seen(self) -> dict:
        return httpx.get(self.url + "/control", timeout=5).json()["seen"]

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
        self.proc.kill()
        self.proc.wait(10)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        self.start()
        self.wait_ready()


MODEL = "SmolLM2-135M-Instruct"
SERVE_START_TIMEOUT_S = 240          # model loads in parallel on 2 shared cores


class ServeProcess:
    """`deepserve serve` of the default model on a free port, its output in `log_path`.

    `threads` sets OMP_NUM_THREADS: several replicas on 2 cores each with 2 threads would spin against each other.
    """

    def __init__(self, log_path: str, *flags: str, threads: int | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")  # noqa: SIM115 - written by the server until stop()
        env = {k: v for k, v in os.environ.items() if k != "DEEPSERVE_API_KEY"}
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        self.proc = subprocess.Popen([sys.executable, "-m", "deepserve.cli", "serve", "--port", str(self.port),
                                      "--max-model-len", "256", "--seed", "0", *flags],
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
            self.proc.send_signal(signal.SIGCONT)      # a stopped process never handles the SIGTERM
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


@contextlib.contextmanager
def serve_processes(log_dir, n: int, *flags: str, threads: int | None = None) -> Iterator[list[ServeProcess]]:
    """n replicas started together (their model loads overlap), each warmed by one request: the first request
    of a fresh process pays one-time costs that would otherwise land in whatever a test measures first."""
    procs = [ServeProcess(os.path.join(str(log_dir), f"replica{i}.log"), *flags, threads=threads) for i in range(n)]
    try:
        for proc in procs:
            wait_until(proc.ready, SERVE_START_TIMEOUT_S, 0.25, what=f"{proc.url} up")
        for proc in procs:
            body = {"model": MODEL, "prompt": "Warm up", "max_tokens": 2}
            assert httpx.post(proc.url + "/v1/completions", json=body, timeout=120).status_code == 200
        yield procs
    finally:
        for proc in procs:
            proc.stop()


@contextlib.contextmanager
def fake_replicas(n: int) -> Iterator[list[FakeReplicaProcess]]:
    replicas = [FakeReplicaProcess() for _ in range(n)]        # started together, waited for together
    try:
        for replica in replicas:
            replica.wait_ready()
        yield replicas
    finally:
        for replica in replicas:
            if replica.proc is not None and replica.proc.poll() is None:
                replica.kill()


class ThreadRouter:
    """The router app under uvicorn in a thread of this process: tests can read its state directly."""

    def __init__(self, config: RouterConfig) -> None:
        import uvicorn

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.app = build_router_app(config)
        self.state = self.app.state.router
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error",
                                                    access_log=False, timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadRouter:
        self.thread.start()
        wait_until(lambda: self.server.started, START_TIMEOUT_S, what="router started")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)

    def replica(self, url: str):
        return self.state.replicas.get(url)

    def metric(self, name: str, **labels) -> float:
        value = self.state.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


def thread_router(replicas: list[str], **overrides) -> ThreadRouter:
    return ThreadRouter(RouterConfig(replicas=replicas, **{**FAST, **overrides}))


def read_stream(response: httpx.Response) -> tuple[list[dict], list[float]]:
    """The JSON payloads of an SSE response (up to [DONE], which is the string "[DONE]") and their arrival times."""
    events, times = [], []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
            times.append(time.monotonic())
    return events, times


def run_async(coro):
    return asyncio.run(coro)
