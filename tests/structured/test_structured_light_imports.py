"""xgrammar (and the transformers it imports) loads only when a request's grammar is checked or compiled."""

from __future__ import annotations

import subprocess
import sys


def loaded(code: str) -> bool:
    probe = code + "\nimport sys\nprint('xgrammar' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1] == "True"


def test_params_and_the_sampler_do_not_import_xgrammar():
    assert not loaded("from deepserve import SamplingParams\n"
                      "SamplingParams(structured_outputs={'json': {'type': 'object'}})\n"
                      "import deepserve.layers.sampler, deepserve.engine.engine")


def test_checking_a_grammar_does():
    assert loaded("from deepserve.structured.compiler import to_grammar\n"
                  "from deepserve.structured.spec import GrammarSpec\n"
                  "to_grammar(GrammarSpec('regex', 'a+'))")
