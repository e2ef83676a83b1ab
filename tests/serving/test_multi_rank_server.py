"""`deepserve serve --dp 2 --ep 2` on CPU processes: concurrent completions all finish, the expert balancer runs
(`deepserve:moe_lb` and `deepserve:eplb_rebalances` on /metrics), and SIGTERM stops every rank."""

from __future__ import annotations

import concurrent.futures
import os

import httpx
import pytest

from tests.engine.test_multi_rank_engine import COMMON
from tests.models.hf_compare import save_tiny
from tests.router.router_harness import ServeProcess, wait_until


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory) -> str:
    import transformers
    cfg = transformers.MixtralConfig(**COMMON, num_hidden_layers=2, intermediate_size=64, num_local_experts=8,
                                     num_experts_per_tok=2)
    return save_tiny(tmp_path_factory.mktemp("mixtral"), cfg, transformers.MixtralForCausalLM)


def test_data_and_expert_parallel_server(tiny_mixtral, tmp_path):
    server = ServeProcess(os.path.join(tmp_path, "serve.log"), "--model", tiny_mixtral, "--skip-tokenizer-init",
                          "--device", "cpu", "--dtype", "float32", "--dp", "2", "--ep", "2",
                          "--num-redundant-experts", "2", "--eplb-interval", "4", "--eplb-window", "8")
    try:
        wait_until(server.ready, 120, 0.25, what="the multi-rank server up")

        def complete(i: int) -> dict:
            body = {"model": os.path.basename(tiny_mixtral), "prompt": list(range(5 + i, 20 + 2 * i)), "max_tokens": 12,
                    "temperature": 0, "ignore_eos": True}
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(complete, range(6)))
        assert [r["usage"]["completion_tokens"] for r in replies] == [12] * 6
        assert server.metric("deepserve:eplb_rebalances_total") >= 1
        assert server.metric("deepserve:moe_lb") >= 1.0
    finally:
        server.stop()
    assert server.proc.returncode == 0, open(server.log.name).read()[-3000:]
