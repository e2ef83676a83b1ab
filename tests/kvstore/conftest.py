"""KV store fixtures: a real redis-server on a free port (killed and restarted by tests), shared engine settings."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from kv_settings import ENGINE, GREEDY


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Greedy tokens of an engine without a store, by prompt (cached per module)."""
    from deepserve import LLM
    llm = LLM(tiny_llama, **ENGINE)
    cache = {}

    def tokens(prompt, params=GREEDY):
        key = (tuple(prompt), params.max_tokens)
        if key not in cache:
            llm.reset_prefix_cache()
            cache[key] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
        return cache[key]
    return tokens

REDIS_BIN = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process (no persistence: a killed server comes back empty)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([REDIS_BIN, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start listening")

    def kill(self) -> None:
        """SIGKILL: the server goes away mid-whatever, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


@pytest.fixture(scope="session")
def tiny_llama_other(tmp_path_factory) -> str:
    """A tiny Llama with tiny_llama's config and other weights (tests/conftest.py's writer, seed 1)."""
    spec = importlib.util.spec_from_file_location("tests_conftest", Path(__file__).resolve().parents[1] / "conftest.py")
    root = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root)
    return root.save_tiny_model(tmp_path_factory.mktemp("tiny_llama_seed1"), "llama", seed=1)


@pytest.fixture
def redis_server():
    if REDIS_BIN is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server; .ci/run installs it "
                    "where apt is available)")
    pytest.importorskip("redis", reason="the redis Python package is not installed (pip install 'deepserve[kvstore]')")
    server = RedisServer(free_port())
    server.start()
    yield server
    server.kill()
