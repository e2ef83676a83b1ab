"""Load, fuzzing and shutdown against one live server (no auth, short context so every request is quick).

Order matters and is pytest's file order: the load test reads counters from a fresh server, and the
SIGTERM test, last, stops the server.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
import subprocess
import sys

import httpx
import pytest
from serving_harness import MODEL_NAME, running_server, schemathesis_cli, scrape_metrics, wait_until_idle

NUM_REQUESTS = 200
CONCURRENCY = 32
MAX_TOKENS = 4
LOAD_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with running_server(["--max-model-len", "64", "--seed", "0"], tmp_path_factory.mktemp("load_server")) as srv:
        yield srv


async def _stream_one(client: httpx.AsyncClient, i: int) -> dict:
    body = {"model": MODEL_NAME, "prompt": f"Request {i}: list some {i % 7} words about the number {i}",
            "max_tokens": MAX_TOKENS, "temperature": 0.7, "seed": i, "stream": True,
            "stream_options": {"include_usage": True}}
    text, usage, done = "", None, False
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            return {"status": response.status_code, "error": (await response.aread()).decode()[:200]}
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                return {"status": 200, "error": chunk["error"]}
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                text += choice["text"]
    return {"status": 200, "usage": usage, "done": done, "text": text}


async def _load(base_url: str) -> list[dict]:
    """Send every request (at most CONCURRENCY at once); a request unfinished after LOAD_TIMEOUT_S is a failure."""
    gate = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)

    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:
        async def guarded(i: int) -> dict:
            async with gate:
                return await _stream_one(client, i)
        tasks = [asyncio.ensure_future(guarded(i)) for i in range(NUM_REQUESTS)]
        _, unfinished = await asyncio.wait(tasks, timeout=LOAD_TIMEOUT_S)
        for task in unfinished:
            task.cancel()
        if unfinished:
            state = {k: v for k, v in scrape_metrics(base_url).items() if k.startswith("deepserve:num_requests")}
            pytest.fail(f"{len(unfinished)} of {NUM_REQUESTS} requests unfinished after {LOAD_TIMEOUT_S} s; "
                        f"server: {state}")
        return [task.result() for task in tasks]


def test_load_32_concurrent_streams(server):
    before = scrape_metrics(server.base_url)
    results = asyncio.run(_load(server.base_url))
    errors = [r for r in results if r["status"] != 200 or "error" in r or not r["done"]]
    assert not errors, errors[:3]
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in results)
    completion_tokens = sum(r["usage"]["completion_tokens"] for r in results)
    assert all(1 <= r["usage"]["completion_tokens"] <= MAX_TOKENS for r in results)

    after = wait_until_idle(server.base_url)
    assert after["deepserve:num_requests_running"] == 0 and after["deepserve:num_requests_waiting"] == 0
    assert after["deepserve:kv_cache_free_blocks"] == after["deepserve:kv_cache_total_blocks"]

    def sent(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)
    assert sent("deepserve:request_success_total") == NUM_REQUESTS
    assert sent("deepserve:e2e_request_latency_seconds_count") == NUM_REQUESTS
    assert sent("deepserve:time_to_first_token_seconds_count") == NUM_REQUESTS
    assert sent("deepserve:request_prompt_tokens_sum") == prompt_tokens
    assert sent("deepserve:request_generation_tokens_sum") == completion_tokens
    assert sent("deepserve:generation_tokens_total") == completion_tokens
    # The engine counts prompt tokens it computed: prefix-cache hits are not recomputed.
    assert 0 < sent("deepserve:prompt_tokens_total") <= prompt_tokens
    assert sent("deepserve:request_rejected_total") == 0


def test_bench_serve_cli(server, tmp_path):
    out = tmp_path / "bench.json"
    command = [sys.executable, "-m", "deepserve.cli", "bench", "serve", "--base-url", server.base_url,
               "--num-prompts", "6", "--request-rate", "20", "--max-concurrency", "1", "4", "--input-len", "12",
               "--output-len", "4", "--goodput", "ttft:60000", "e2e:60000", "--output-json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    payload = json.loads(out.read_text())
    assert [run["max_concurrency"] for run in payload["runs"]] == [1, 4]
    for run in payload["runs"]:
        assert run["completed"] == 6 and run["failed"] == 0
        assert run["total_output_tokens"] == 6 * 4
        assert run["ttft_ms"]["median"] > 0 and run["e2e_ms"]["p99"] >= run["ttft_ms"]["median"]
        assert run["goodput"]["fraction"] == 1.0
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "bench.png").stat().st_size > 0


def test_bench_serve_from_two_client_processes(server, tmp_path):
    """--client-processes 2: the prompts, the concurrency and the rate split between two processes; one merged run."""
    out = tmp_path / "bench2.json"
    command = [sys.executable, "-m", "deepserve.cli", "bench", "serve", "--base-url", server.base_url,
               "--num-prompts", "7", "--max-concurrency", "4", "--input-len", "12", "--output-len", "3",
               "--client-processes", "2", "--output-json", str(out), "--plot", str(tmp_path / "p.png")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    run, = json.loads(out.read_text())["runs"]
    assert run["client_processes"] == 2 and run["completed"] == 7 and run["failed"] == 0
    assert run["total_output_tokens"] == 7 * 3 and run["duration_s"] > 0 and run["ttft_ms"]["median"] > 0


@pytest.mark.skipif(schemathesis_cli() is None, reason="schemathesis is not installed")
def test_openapi_schema_fuzzing_finds_no_5xx(server, tmp_path):
    """Schemathesis generates requests (valid and invalid) from the served schema: no 5xx, no hang."""
    cli = schemathesis_cli()
    command = [cli, "run", server.base_url + "/openapi.json", "--checks", "not_a_server_error",
               "--max-examples", "12", "--request-timeout", "60", "--max-time", "20", "--workers", "1",
               "--seed", "1", "--no-shrink", "--suppress-health-check", "all", "--phases", "coverage,fuzzing",
               "--report-dir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=150, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert httpx.get(server.base_url + "/health").status_code == 200
    metrics = wait_until_idle(server.base_url)
    assert metrics["deepserve:kv_cache_free_blocks"] == metrics["deepserve:kv_cache_total_blocks"]


def test_sigterm_drains_in_flight_requests_then_exits(server):
    """Last test of the module: it stops the server."""
    body = {"prompt": "Once upon a time", "max_tokens": 24, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks, finish = [], None
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data:"):
                break
        server.proc.send_signal(signal.SIGTERM)         # mid-stream
        for line in lines:
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[len("data:"):])
            chunks.append(chunk)
            for choice in chunk["choices"]:
                finish = choice["finish_reason"] or finish
    assert finish == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 24
    assert server.proc.wait(60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.base_url + "/health", timeout=5)
