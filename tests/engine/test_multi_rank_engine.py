"""The multi-rank engine (engine/multi_rank_engine.py) on CPU processes over gloo: tensor, data and expert
parallelism give the single-process engine's greedy tokens; skewed loads (one replica idle, one overloaded, prompts
arriving mid-decode, a request aborted on one replica) finish every request without a deadlock; EPLB rebalancing
mid-run changes no token.

Each scenario runs in a process of its own (`run_scenario`), which is rank 0 and spawns the other ranks; a scenario
still running at its timeout fails the test and is killed, so a deadlock cannot hang the suite.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import subprocess
import sys
import traceback

import pytest
import torch

from deepserve import LLM, SamplingParams
from tests.models.hf_compare import save_tiny, save_tiny_deepseek

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
COMMON = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=256)


def _prompts(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(0, 256, (int(l),), generator=g).tolist()}
            for l in torch.randint(3, 40, (n,), generator=g)]


@pytest.fixture(scope="module")
def tiny_mixtral(tmp_path_factory) -> str:
    import transformers
    cfg = transformers.MixtralConfig(**COMMON, num_hidden_layers=2, intermediate_size=64, num_local_experts=8,
                                     num_experts_per_tok=2)
    return save_tiny(tmp_path_factory.mktemp("mixtral"), cfg, transformers.MixtralForCausalLM)


@pytest.fixture(scope="module")
def tiny_llama_mr(tmp_path_factory) -> str:
    import transformers
    cfg = transformers.LlamaConfig(**COMMON, num_hidden_layers=2, intermediate_size=128)
    return save_tiny(tmp_path_factory.mktemp("llama"), cfg, transformers.LlamaForCausalLM)


@pytest.fixture(scope="module")
def tiny_deepseek_v3(tmp_path_factory) -> str:
    """MLA (4 heads), a dense first layer, MoE with a shared expert and grouped sigmoid routing."""
    return save_tiny_deepseek(tmp_path_factory.mktemp("deepseek_v3"), 3, vocab_size=256, n_group=4, topk_group=2,
                              q_lora_rank=48, routed_scaling_factor=2.5)


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def reference(path: str, prompts, params=GREEDY) -> list[list[int]]:
    llm = LLM(path, skip_tokenizer_init=True, device="cpu", dtype="float32")
    return _tokens(llm.generate(prompts, params, use_tqdm=False))


# --- scenarios: run in a process of their own, which is rank 0 ---------------------------------------
def _generate(path: str, prompts, engine_kwargs: dict, params=GREEDY) -> dict:
    with LLM(path, skip_tokenizer_init=True, device="cpu", dtype="float32", **engine_kwargs) as llm:
        tokens = _tokens(llm.generate(prompts, params, use_tqdm=False))
        stats = llm.engine.get_stats()
        replicas = [s.prompt_tokens if s is not None else 0 for s in llm.engine._stats]
        model = llm.engine.local.runner.model
        local_experts = [layer.w13.shape[0] for layer in model.moe_layers()] if hasattr(model, "moe_layers") else []
    return {"tokens": tokens, "moe_lb": stats.moe_lb, "rebalances": stats.num_eplb_rebalances,
            "replica_prompt_tokens": replicas, "local_experts": local_experts}


def _skewed(path: str, prompts, engine_kwargs: dict) -> dict:
    """Two requests first; three more arrive after a few decode steps; one of them is aborted on its replica."""
    with LLM(path, skip_tokenizer_init=True, device="cpu", dtype="float32", **engine_kwargs) as llm:
        engine = llm.engine
        for i in range(2):
            engine.add_request(str(i), prompts[i], GREEDY)
        finished = {}
        for _ in range(5):
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = _tokens([out])[0]
        for i in range(2, len(prompts)):
            engine.add_request(str(i), prompts[i], GREEDY)
        engine.step()
        engine.abort_request("3")
        steps = 0
        while engine.has_unfinished_requests():
            steps += 1
            assert steps < 2000, "the engine stopped making progress"
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = _tokens([out])[0]
    return {"finished": finished}


def _scenario_entry(fn, args, results) -> None:
    try:
        results.put(("ok", fn(*args)))
    except BaseException:       # noqa: BLE001 - reported to the test
        results.put(("error", traceback.format_exc()))


def run_scenario(fn, *args, timeout: float = 180.0):
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_scenario_entry, args=(fn, args, results))
    proc.start()
    try:
        status, value = results.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"{fn.__name__} still running after {timeout} s: a deadlock?") from None
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    assert status == "ok", value
    return value


# --- tests -------------------------------------------------------------------------------------------------
def test_data_parallel_two_replicas_match_one_process(tiny_llama_mr):
    prompts = _prompts(5)
    got = run_scenario(_generate, tiny_llama_mr, prompts, {"data_parallel_size": 2})
    assert got["tokens"] == reference(tiny_llama_mr, prompts)
    assert all(t > 0 for t in got["replica_prompt_tokens"])      # both replicas served requests


@pytest.mark.parametrize("model", ["tiny_llama_mr", "tiny_mixtral"])
def test_tensor_parallel_two_ranks_match_one_process(model, request):
    """Llama: heads and the MLP split; Mixtral: heads and every expert's intermediate dimension split."""
    path = request.getfixturevalue(model)
    prompts = _prompts(4, seed=4)
    got = run_scenario(_generate, path, prompts, {"tensor_parallel_size": 2})
    assert got["tokens"] == reference(path, prompts)


def test_deepseek_v3_tp2_dp2_ep4_matches_one_process(tiny_deepseek_v3):
    """4 ranks: MLA heads and dense / shared-expert weights split over each TP pair, routed experts spread over all
    four (2 per rank), two data-parallel replicas, skewed (3 requests)."""
    prompts = _prompts(3, seed=5)
    got = run_scenario(_generate, tiny_deepseek_v3, prompts,
                       {"tensor_parallel_size": 2, "data_parallel_size": 2, "expert_parallel_size": 4})
    assert got["local_experts"] == [2, 2]
    assert got["tokens"] == reference(tiny_deepseek_v3, prompts)


def test_skewed_arrivals_and_an_abort_never_deadlock(tiny_mixtral):
    """DP 2 x EP 2: replica 1 is idle at first (placeholder forwards keep the all-to-alls matched), prompts arrive
    mid-decode, request 3 is aborted on its replica; every other request finishes with the reference tokens."""
    prompts = _prompts(5, seed=1)
    got = run_scenario(_skewed, tiny_mixtral, prompts, {"data_parallel_size": 2, "expert_parallel_size": 2})
    ref = reference(tiny_mixtral, prompts)
    assert sorted(got["finished"]) == ["0", "1", "2", "4"]
    for key, tokens in got["finished"].items():
        assert tokens == ref[int(key)], key


def test_expert_parallel_with_eplb_rebalancing_mid_run_changes_no_token(tiny_mixtral):
    prompts = _prompts(6, seed=2)
    got = run_scenario(_generate, tiny_mixtral, prompts,
                       {"data_parallel_size": 2, "expert_parallel_size": 2, "num_redundant_experts": 2,
                        "eplb_interval": 4, "eplb_window": 8})
    assert got["rebalances"] >= 1 and got["moe_lb"] is not None and got["moe_lb"] >= 1.0
    assert got["local_experts"] == [5, 5]          # (8 experts + 2 replicas) / 2 ranks, in each MoE layer
    assert got["tokens"] == reference(tiny_mixtral, prompts)


def test_four_replicas_one_idle(tiny_mixtral):
    """DP 4 x EP 4 with 3 requests: one replica gets none (idle throughout), the others one each."""
    prompts = _prompts(3, seed=3)
    got = run_scenario(_generate, tiny_mixtral, prompts, {"data_parallel_size": 4, "expert_parallel_size": 4})
    assert got["tokens"] == reference(tiny_mixtral, prompts)
    assert sorted(t > 0 for t in got["replica_prompt_tokens"]) == [False, True, True, True]
    assert got["local_experts"] == [2, 2]


def test_four_replicas_one_overloaded(tiny_mixtral):
    """DP 4 x EP 4 with 5 requests: replica 0 gets two long ones and keeps decoding long after the other three
    finished theirs (they then run placeholder forwards only)."""
    prompts = _prompts(5, seed=7)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (40, 4, 4, 4, 40)]
    got = run_scenario(_generate, tiny_mixtral, prompts, {"data_parallel_size": 4, "expert_parallel_size": 4},
                       params)
    assert got["tokens"] == reference(tiny_mixtral, prompts, params)
    assert [len(t) for t in got["tokens"]] == [40, 4, 4, 4, 40]


def test_the_same_entry_point_under_torchrun(tiny_llama_mr):
    """torchrun's c10d rendezvous starts both ranks; TP 2: rank 0 prints the single-process engine's tokens."""
    prompts = _prompts(3, seed=6)
    script = os.path.join(os.path.dirname(__file__), "torchrun_generate.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    # --standalone: torchrun's c10d rendezvous on this host, on a port it picks itself.
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script,
                          tiny_llama_mr, json.dumps(prompts), json.dumps({"tensor_parallel_size": 2})],
                         capture_output=True, text=True, timeout=180, env=env)
    assert run.returncode == 0, run.stdout[-1500:] + run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if line.startswith("TOKENS ")]
    assert len(lines) == 1                 # rank 0 only
    assert json.loads(lines[0][len("TOKENS "):]) == reference(tiny_llama_mr, prompts)


def test_bad_parallel_sizes_are_refused_before_any_rank_starts(tiny_llama_mr):
    with pytest.raises(ValueError, match="expert_parallel_size 3"):
        LLM(tiny_llama_mr, skip_tokenizer_init=True, device="cpu", data_parallel_size=2, expert_parallel_size=3)
    with pytest.raises(ValueError, match="eplb_interval needs expert_parallel_size"):
        LLM(tiny_llama_mr, skip_tokenizer_init=True, device="cpu", data_parallel_size=2, eplb_interval=10)
