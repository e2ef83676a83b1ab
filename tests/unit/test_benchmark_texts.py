"""The NLL benchmarks' fixed text (benchmarks/cpu_smollm2.py's first 600 tokens, read by cpu_smollm2.py,
cpu_vs_llamacpp.py and kv_cache_dtype.py) must not change, or no NLL measured before is comparable any more: those
600 tokens of the default model's tokenizer are the file's first 1847 characters, whose digest is pinned here."""

import hashlib
from pathlib import Path

NLL_TEXT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_smollm2.py"
FIRST_CHARS = 1847
DIGEST = "41bc653032e7c80e7d9be9b09b0eabbf19c9e20e0229790a11bcd782d71dc8d7"


def test_the_nll_text_is_unchanged():
    head = NLL_TEXT.read_text()[:FIRST_CHARS]
    assert hashlib.sha256(head.encode()).hexdigest() == DIGEST, (
        "the start of benchmarks/cpu_smollm2.py is the NLL benchmarks' text: edit below its first 600 tokens")
