"""Prefill/decode disaggregation end to end (router/pd.py, serving/openai/pd_role.py): a `serve --role prefill` and a
`serve --role decode` replica of the default model share a disk KV store behind the router. Outputs must equal an
engine's without disaggregation (greedy); the decode replica, which never saw the prompts, reads them from the store;
a prefill replica killed mid-load loses no request."""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from router_harness import (
    MODEL,
    SERVE_START_TIMEOUT_S,
    ServeProcess,
    serve_cluster,
    thread_router,
    wait_until,
)

from deepserve.sampling_params import SamplingParams

MAX_TOKENS = 8


def token_prompts(n: int, length: int = 160, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(length)] for _ in range(n)]


@pytest.fixture(scope="module")
def pd_replicas(tmp_path_factory):
    kv_store = json.dumps({"backend": "disk", "path": str(tmp_path_factory.mktemp("kv"))})
    logs = tmp_path_factory.mktemp("pd")
    procs = [ServeProcess(os.path.join(str(logs), f"{role}.log"), "--role", role, "--kv-store", kv_store, threads=1)
             for role in ("prefill", "decode")]
    try:
        for proc in procs:
            wait_until(proc.ready, SERVE_START_TIMEOUT_S, 0.25, what=f"{proc.url} up")
        yield procs
    finally:
        for proc in procs:
            proc.stop()


def colocated_texts(smollm, prompts):
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    smollm.reset_prefix_cache()
    return [o.outputs[0].text for o in smollm.generate([{"prompt_token_ids": p} for p in prompts], greedy,
                                                       use_tqdm=False)]


def complete(base_url: str, prompt: list[int]) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_pd_outputs_equal_colocated_and_decode_reads_the_store(pd_replicas, smollm):
    prefill, decode = pd_replicas
    prompts = token_prompts(3)
    expected = colocated_texts(smollm, prompts)
    with thread_router([decode.url], prefill_replicas=[prefill.url]) as router:
        wait_until(lambda: router.state.replicas.eligible(), 10, what="decode replica eligible")
        answers = [complete(router.base_url, p) for p in prompts]
        assert router.state.prefill.succeeded == 3 and router.state.prefill.failed == 0
    assert [a["choices"][0]["text"] for a in answers] == expected
    for prompt, answer in zip(prompts, answers):
        # 160 tokens: 9 full blocks of 16 come from the store (the decode replica never computed them).
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * len(prompt)


def test_prefill_replica_killed_mid_load_loses_no_request(pd_replicas, smollm):
    prefill, decode = pd_replicas
    prompts = token_prompts(4, seed=1)
    expected = colocated_texts(smollm, prompts)
    with thread_router([decode.url], prefill_replicas=[prefill.url], read_timeout_s=120.0) as router:
        wait_until(lambda: router.state.replicas.eligible(), 10, what="decode replica eligible")
        with ThreadPoolExecutor(len(prompts)) as pool:
            first = pool.submit(complete, router.base_url, prompts[0])
            wait_until(lambda: router.state.prefill.succeeded >= 1, 120, 0.02, what="a first prefill")
            rest = [pool.submit(complete, router.base_url, p) for p in prompts[1:]]
            time.sleep(0.3)                 # the rest are at the prefill replica (or on their way) when it dies
            prefill.proc.kill()
            prefill.proc.wait(10)
            answers = [f.result(timeout=180) for f in [first, *rest]]
        assert router.state.prefill.failed >= 1
    assert [a["choices"][0]["text"] for a in answers] == expected


def test_pd_split_flags():
    from deepserve.router.options import parse_pd_split
    from deepserve.router.pd_cluster import pd_children

    assert parse_pd_split("1:2") == (1, 2)
    for bad in ("2", "0:1", "a:b"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_pd_split(bad)
    children = pd_children(["--pd", "1:2", "--replicas", "3", "--role=decode", "--kv-store", "{}", "--port", "9"], 1, 2)
    assert [argv for _, argv in children] == [["--kv-store", "{}", "--role", role]
                                             for role in ("prefill", "decode", "decode")]


def test_serve_pd_group_on_one_host(tmp_path, smollm):
    """`deepserve serve --replicas 2 --pd 1:1`: one command, a prefill and a decode engine behind a router."""
    kv_store = json.dumps({"backend": "disk", "path": str(tmp_path / "kv")})
    with serve_cluster(tmp_path / "pd.log", "--replicas", "2", "--pd", "1:1", "--kv-store", kv_store) as (base_url,
                                                                                                          proc):
        def up() -> bool:
            assert proc.poll() is None, (tmp_path / "pd.log").read_text()[-3000:]
            try:
                return httpx.get(base_url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(up, SERVE_START_TIMEOUT_S, 0.5, what="the PD group up")
        prompt = token_prompts(1, seed=2)[0]
        answer = complete(base_url, prompt)
        assert answer["choices"][0]["text"] == colocated_texts(smollm, [prompt])[0]
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * len(prompt)
