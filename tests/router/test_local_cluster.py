"""`deepserve serve --replicas 2`: two real engines and a router in one command; a killed engine is started again;
SIGTERM stops everything. Slow (two model loads): run with -m slow."""

from __future__ import annotations

import signal
import subprocess
import sys

import httpx
import pytest
from router_harness import free_port, wait_until

pytestmark = pytest.mark.slow


def test_serve_replicas_runs_engines_behind_a_router(tmp_path):
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "cluster.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "deepserve.cli", "serve", "--replicas", "2", "--port", str(port),
                             "--max-model-len", "256"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def replicas() -> list[dict]:
        try:
            return httpx.get(base_url + "/router/replicas", timeout=2).json()["replicas"]
        except httpx.HTTPError:
            return []
    try:
        wait_until(lambda: len([r for r in replicas() if r["healthy"]]) == 2, 240, 0.5, what="two replicas up")
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "Hello", "max_tokens": 3}
        assert httpx.post(base_url + "/v1/completions", json=body, timeout=60).status_code == 200
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 2
        subprocess.run(["kill", "-9", children[0]], check=True)
        wait_until(lambda: len([r for r in replicas() if r["healthy"]]) == 1, 30, 0.1, what="killed one out")
        wait_until(lambda: len([r for r in replicas() if r["healthy"]]) == 2, 240, 0.5, what="killed one back")
        assert httpx.post(base_url + "/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    assert proc.returncode == 0, (tmp_path / "cluster.log").read_text()[-3000:]
    leftover = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert not leftover
