"""Offline benchmarks: run_latency / run_throughput on a tiny model (CPU), and the parts of
benchmarks/h200_dense.py that need no GPU (byte counts, the phase guard, summary, JSON, plot, dry run)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import pytest

from deepserve import LLM
from deepserve.bench.throughput import run_latency, run_throughput

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def dense():
    spec = importlib.util.spec_from_file_location("h200_dense", os.path.join(ROOT, "benchmarks", "h200_dense.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def llm(tiny_llama):
    # A 16-token step budget: a batch of 8-token prompts needs several steps of (chunked) prefill.
    return LLM(tiny_llama, skip_tokenizer_init=True, load_format="dummy", dtype="float32", block_size=8,
               max_num_batched_tokens=16, max_num_seqs=8)


def test_latency_batch1_times_every_decode_step(llm):
    r = run_latency(llm, batch_size=1, input_len=8, output_len=5)
    # The first step prefills and samples token 1; tokens 2..5 come from 4 decode steps over 9..12 tokens.
    assert r["decode_steps_timed"] == 4
    assert r["mean_context_len"] == pytest.approx(10.5)
    assert r["decode_tokens_per_s"] > 0 and r["prefill_s"] > 0 and r["total_s"] >= r["prefill_s"]
    assert not llm.engine.has_unfinished_requests()


def test_latency_skips_steps_where_part_of_the_batch_still_prefills(llm):
    # 4 x 8 prompt tokens over 16-token steps: two requests start decoding a step before the others and
    # finish a step earlier; those steps are not decode steps of the whole batch.
    r = run_latency(llm, batch_size=4, input_len=8, output_len=6)
    assert 1 <= r["decode_steps_timed"] < 5
    assert r["decode_tokens_per_s"] == pytest.approx(4 / (r["decode_ms_per_step"] / 1e3), rel=1e-2)
    assert not llm.engine.has_unfinished_requests()


def test_throughput_counts_this_run_only(llm):
    r = run_throughput(llm, num_prompts=6, input_len=8, output_len=4, temperature=0.0)
    assert r["num_prompts"] == 6 and r["num_preemptions"] == 0 and r["temperature"] == 0.0
    # elapsed_s is rounded to the millisecond (a run this small takes a few), the rate is not.
    assert 24 / r["output_tokens_per_s"] == pytest.approx(r["elapsed_s"], abs=6e-4)


def test_dense_byte_counts_match_the_targets(dense):
    one_b, eight_b = dense.SHAPES["llama-3.2-1b"], dense.SHAPES["llama-3-8b"]
    assert dense.weight_bytes(one_b) == 2471493632 == dense.decode_read_bytes(one_b)   # tied embeddings
    assert dense.decode_read_bytes(eight_b) < dense.weight_bytes(eight_b)
    assert dense.kv_bytes_per_token(one_b) == 16 * 2 * 8 * 64 * 2
    # The acceptance's batch-1 targets are 70% of bandwidth / all parameter bytes.
    for name, tokens in dense.TARGETS["batch1_tokens_per_s"].items():
        roofline = dense.STATED_COPY_BANDWIDTH / dense.weight_bytes(dense.SHAPES[name])
        assert tokens == pytest.approx(0.7 * roofline, rel=0.01)


def test_phase_records_errors_and_skips_after_the_deadline(dense, tmp_path):
    ph = dense.Phase(str(tmp_path / "phase.json"), deadline=time.time() + 60)
    assert ph.measure("ok", lambda: {"x": 1}) == {"x": 1}
    assert ph.measure("bad", lambda: 1 / 0) is None
    ph.deadline = time.time() - 1
    assert ph.measure("late", lambda: {"x": 2}) is None
    saved = json.loads((tmp_path / "phase.json").read_text())
    assert saved["ok"] == {"x": 1} and "ZeroDivisionError" in saved["bad"]["error"] and "skipped" in saved["late"]


def _fake_results() -> dict:
    ds = {"startup": {"startup_s": 30.0, "cuda_graph_capture_s": 5.0},
          "latency_b1": {"decode_tokens_per_s": 1300.0},
          "latency_b32": {"output_tokens_per_s": 20000.0},
          "decode_b64_ctx1k": {"achieved_Bps": 3.0e12},
          "throughput": {"output_tokens_per_s": 50000.0}}
    hf = {"generate_b1": {"decode_tokens_per_s": 20.0}, "generate_b32": {"output_tokens_per_s": 2000.0},
          "generate_batch": {"output_tokens_per_s": 2000.0}}
    return {"machine": {"versions": {"gpu": "fake"}, "copy_bandwidth": {"measured_Bps": 4.3e12}},
            "llama-3.2-1b": {"deepserve": ds, "deepserve_eager": {"latency_b1": {"decode_tokens_per_s": 650.0}},
                             "hf_transformers": hf},
            "llama-3-8b": {"deepserve": {"startup": {"error": "Traceback ..."}},
                           "hf_transformers": {"generate_batch": {"skipped": "time limit"}}}}


def test_summary_json_and_plot(dense, tmp_path):
    out = tmp_path / "dense.json"
    args = dense.parse_args(["--output", str(out)])
    dense.write_results(args, "python benchmarks/h200_dense.py", _fake_results(), time.time())
    data = json.loads(out.read_text())
    assert data["command"] == "python benchmarks/h200_dense.py"
    one_b = data["results"]["llama-3.2-1b"]["summary"]
    assert one_b["graphs_vs_eager_batch1"] == 2.0 and one_b["ratio_offline_vs_hf_generate_batch"] == 25.0
    assert one_b["targets"]["batch1_tokens_per_s"]["pass"] is True
    assert one_b["targets"]["offline_vs_hf_generate_batch"]["pass"] is True
    assert one_b["targets"]["startup_s"]["pass"] is True
    eight_b = data["results"]["llama-3-8b"]["summary"]   # failed measurements: no numbers, no verdicts
    assert eight_b["deepserve_batch1_tokens_per_s"] is None and eight_b["targets"]["startup_s"]["pass"] is None
    pytest.importorskip("matplotlib")
    png = tmp_path / "dense.png"
    dense.plot(str(png), str(out))
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_dry_run_prints_the_plan(dense, capsys):
    dense.main(["--dry-run", "--shapes", "tiny,llama-3.2-1b"])
    text = capsys.readouterr().out
    assert "deepserve:tiny" in text and "deepserve_eager:tiny" in text and "hf_transformers:llama-3.2-1b" in text


def test_unknown_shape_is_refused(dense):
    with pytest.raises(SystemExit):
        dense.parse_args(["--shapes", "llama-99b"])
    assert isinstance(dense.parse_args([]), argparse.Namespace)
