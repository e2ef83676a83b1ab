"""GrammarCompiler: one compile per distinct grammar, shared by every request; bad grammars are ValueErrors."""

from __future__ import annotations

import pytest

from deepserve.structured.compiler import choice_ebnf, to_grammar
from deepserve.structured.spec import GrammarSpec, from_structured_outputs


def test_one_future_per_distinct_grammar(compiler):
    spec = from_structured_outputs({"regex": "cache-[a-z]{2}"})
    first = compiler.submit(spec)
    assert compiler.submit(from_structured_outputs({"regex": "cache-[a-z]{2}"})) is first
    assert compiler.submit(from_structured_outputs({"regex": "cache-[a-z]{3}"})) is not first
    assert first.result(timeout=30) is not None


@pytest.mark.parametrize("spec, says", [
    (GrammarSpec("json", '{"type": "nonsense"}'), "invalid JSON schema"),
    (GrammarSpec("regex", "(ab"), "invalid regex"),
    (GrammarSpec("grammar", "root ::= undefined_rule"), "invalid EBNF grammar"),
])
def test_bad_grammars_are_value_errors(compiler, spec, says):
    with pytest.raises(ValueError, match=says):
        compiler.check(spec)
    future = compiler.submit(spec)
    with pytest.raises(ValueError, match=says):
        future.result(timeout=30)
    assert compiler.submit(spec) is not future          # a failure is not cached


def test_choices_with_quotes_and_unicode_compile_to_their_literals():
    choices = ['say "hi"', "back\\slash", "été", "two\nlines"]
    text = str(to_grammar(GrammarSpec("choice", __import__("json").dumps(choices))))
    assert text.count("|") == len(choices) - 1
    assert choice_ebnf(["a"]) == 'root ::= "a"'
