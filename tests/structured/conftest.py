"""Structured-output tests share the default model's engine (tests/conftest.py `smollm`) and its compiler."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def compiler(smollm):
    return smollm.engine.grammar_compiler


@pytest.fixture(scope="session")
def tokenizer(smollm):
    return smollm.get_tokenizer()


@pytest.fixture(scope="session")
def eos(tokenizer) -> int:
    return min(tokenizer.eos_token_ids)
