"""GrammarSpec: the two request spellings (structured_outputs, so_args) normalise to one spec; bad shapes are
ValueErrors naming the field."""

from __future__ import annotations

import pytest

from deepserve import SamplingParams
from deepserve.structured.spec import GrammarSpec, from_so_args, from_structured_outputs

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


@pytest.mark.parametrize("value, kind", [
    ({"json": SCHEMA}, "json"), ({"regex": r"\d+"}, "regex"), ({"grammar": 'root ::= "x"'}, "grammar"),
    ({"choice": ["yes", "no"]}, "choice"), ({"json_object": True}, "json_object"),
])
def test_each_kind_normalises(value, kind):
    spec = SamplingParams(structured_outputs=value).structured_outputs
    assert isinstance(spec, GrammarSpec) and spec.kind == kind


def test_a_schema_as_dict_or_text_is_one_key_and_keeps_property_order():
    as_dict = from_structured_outputs({"json": SCHEMA})
    as_text = from_structured_outputs({"json": '{"type": "object", "properties": {"b": {"type": "integer"}, '
                                                 '"a": {"type": "string"}}}'})
    assert as_dict.key == as_text.key
    assert as_dict.source.index('"b"') < as_dict.source.index('"a"')        # the output's key order
    assert from_structured_outputs({"json": {**SCHEMA, "required": ["a"]}}).key != as_dict.key


def test_so_args_map_to_kinds_with_their_triggers():
    spec = from_so_args({"schema_type": "ebnf", "schema": 'root ::= "x"', "trigger_token_ids": [5, 6],
                         "bound_token_id": 7})
    assert (spec.kind, spec.trigger_token_ids, spec.bound_token_id) == ("grammar", (5, 6), 7)
    plain = from_so_args({"schema_type": "json", "schema": '{"type": "object"}'})
    assert plain.key == from_structured_outputs({"json": {"type": "object"}}).key    # the same compile
    assert SamplingParams(so_args={"schema_type": "regex", "schema": "a+"}).structured_outputs.kind == "regex"


@pytest.mark.parametrize("kwargs, field", [
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"yaml": "x"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": [1, 2]}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"so_args": {"schema_type": "json", "schema": "{}", "serialized": "..."}}, "so_args"),
    ({"so_args": {"schema_type": "json", "schema": "{}", "bound_token_ids": [1]}}, "so_args"),
    ({"so_args": {"schema_type": "regex", "schema": "a", "bound_token_id": 3}}, "so_args"),
    ({"so_args": {"schema_type": "xml", "schema": "a"}}, "so_args"),
    ({"so_args": {"schema_type": "regex", "schema": "a", "trigger_token_ids": [-1]}}, "so_args"),
    ({"so_args": {"schema_type": "regex", "schema": "a"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
])
def test_bad_shapes_are_value_errors_naming_the_field(kwargs, field):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith(field), str(info.value)
