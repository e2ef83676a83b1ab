"""The command line, run as a user would (subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys



def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "deepserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_prompt_and_jsonl(tmp_path):
    inp = tmp_path / "prompts.jsonl"
    inp.write_text(json.dumps({"prompt": "The capital of France is", "id": "a"}) + "\n"
                   + json.dumps({"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}) + "\n")
    out = tmp_path / "out.jsonl"
    r = run_cli("generate", "--input", str(inp), "--output", str(out), "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 2 and lines[0]["id"] == "a" and lines[0]["text"]
    assert len(lines[1]["token_ids"]) <= 4


def test_generate_single_prompt_prints_completion():
    r = run_cli("generate", "The capital of France is", "--max-tokens", "6")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_bad_flag_value_is_a_clear_error(tiny_llama):
    r = run_cli("generate", "hi", "--model", tiny_llama, "--dtype", "float8")
    assert r.returncode == 2 and "dtype" in r.stderr


def test_bench_throughput_on_dummy_weights(tiny_llama, tmp_path):
    out = tmp_path / "bench.json"
    r = run_cli("bench", "throughput", "--model", tiny_llama, "--load-format", "dummy", "--num-prompts", "8",
                "--input-len", "16", "--output-len", "8", "--output-json", str(out))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["command"].startswith("deepserve bench throughput")
    assert data["result"]["num_prompts"] == 8 and data["result"]["output_tokens_per_s"] > 0
