"""A real `deepserve serve` process on 127.0.0.1 (free port), started once per test module.

Every wait here is bounded: the server must answer /health within SERVER_START_TIMEOUT_S, and stopping
sends SIGTERM, then SIGKILL after STOP_TIMEOUT_S.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx

SERVER_START_TIMEOUT_S = 240
STOP_TIMEOUT_S = 60
MODEL_NAME = "SmolLM2-135M-Instruct"


def schemathesis_cli() -> str | None:
    """The schemathesis command installed beside this Python (or on PATH), None without it."""
    beside_python = os.path.join(os.path.dirname(sys.executable), "schemathesis")
    return beside_python if os.path.exists(beside_python) else shutil.which("schemathesis")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], log_path: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - the server process writes to it until stop()
        command = [sys.executable, "-m", "deepserve.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                   *args]
        # A DEEPSERVE_API_KEY in the developer's shell must not turn on auth for servers a test starts without it.
        base = {k: v for k, v in os.environ.items() if k != "DEEPSERVE_API_KEY"}
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env={**base, **(env or {})})

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the server did not become healthy in {SERVER_START_TIMEOUT_S} s:\n{self.log_tail()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-chars:]


@contextlib.contextmanager
def running_server(args: list[str], log_dir, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """`env`: variables added to this process's environment for the server."""
    server = ServerProcess(args, os.path.join(str(log_dir), "server.log"), env)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def scrape_metrics(base_url: str) -> dict[str, float]:
    """/metrics as {name{labels}: value}, and {name: sum over label sets} for each metric name."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        values[series] = float(value)
        name = re.sub(r"\{.*\}", "", series)
        if name != series:
            values[name] = values.get(name, 0.0) + float(value)
    return values


def wait_until_idle(base_url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and every KV block is free; return the last scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = scrape_metrics(base_url)
        idle = (metrics["deepserve:num_requests_running"] == 0 and metrics["deepserve:num_requests_waiting"] == 0
                and metrics["deepserve:kv_cache_free_blocks"] == metrics["deepserve:kv_cache_total_blocks"])
        if idle or time.monotonic() > deadline:
            return metrics
        time.sleep(0.2)
