"""`import deepserve` and the offline commands never load the serving stack (each check in a fresh interpreter,
reading sys.modules afterwards)."""

from __future__ import annotations

import json
import subprocess
import sys

SERVING_STACK = ("fastapi", "uvicorn", "starlette", "prometheus_client", "httpx")


def loaded_after(code: str) -> dict[str, bool]:
    probe = code + "\nimport json, sys\nprint(json.dumps({m: m in sys.modules for m in %r + ('torch',)}))" % (
        SERVING_STACK,)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_deepserve_is_light():
    loaded = loaded_after("import deepserve; deepserve.__version__")
    assert not any(loaded.values()), loaded       # not even torch


def test_public_names_load_on_first_use():
    loaded = loaded_after("from deepserve import LLM, SamplingParams, EngineArgs, RequestOutput")
    assert loaded["torch"]
    assert not any(loaded[m] for m in SERVING_STACK), loaded


def test_the_cli_parser_loads_neither_torch_nor_the_serving_stack():
    # `deepserve --help` and `deepserve env` build the whole parser (every subcommand's flags).
    loaded = loaded_after("from deepserve.cli import build_parser; build_parser().parse_args(['env'])")
    assert not any(loaded.values()), loaded


def test_deepserve_generate_does_not_load_the_serving_stack(tiny_llama, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt_token_ids": [1, 2, 3]}) + "\n")
    code = ("from deepserve.cli import main\n"
            f"assert main(['generate', '--input', {str(prompts)!r}, '--output', {str(tmp_path / 'out.jsonl')!r}, "
            f"'--model', {tiny_llama!r}, '--max-tokens', '2', '--skip-tokenizer-init']) == 0")
    loaded = loaded_after(code)
    assert loaded["torch"]
    assert not any(loaded[m] for m in SERVING_STACK), loaded


def test_bench_latency_does_not_load_the_serving_stack(tiny_llama):
    code = ("from deepserve.cli import main\n"
            f"assert main(['bench', 'latency', '--model', {tiny_llama!r}, '--input-len', '4', "
            "'--output-len', '2', '--skip-tokenizer-init']) == 0")
    loaded = loaded_after(code)
    assert not any(loaded[m] for m in SERVING_STACK), loaded
