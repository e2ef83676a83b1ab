"""GrammarSpec: the one normalised form of what a request constrains its output to.

Two spellings reach it:
- vLLM's `SamplingParams(structured_outputs={"json": schema} | {"regex": str} | {"grammar": ebnf} |
  {"choice": [str, ...]} | {"json_object": True})`, exactly one kind;
- DeepInfer's `so_args={"schema_type": "json" | "regex" | "ebnf", "schema": str, "trigger_token_ids": [...],
  "bound_token_id": int}` (deepinfer.md §10); "serialized" and "bound_token_ids" are refused.

Invariants: a GrammarSpec is immutable and hashable; `key` is equal for two specs exactly when they compile to
the same grammar (the compile cache's key; triggers are per-sequence matcher state, not part of the grammar).
Only the shape is checked here (pure Python, no xgrammar): whether a schema or an EBNF is valid is decided by
`compiler.check`, which the engine calls at add_request. Errors are ValueErrors naming the field.
"""

# ValueError, not TypeError, for a wrong type too: as in sampling_params.py, every bad request field is a
# ValueError naming it (the server turns those into 400s).
# ruff: noqa: TRY004
from __future__ import annotations

import json
import numbers
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "grammar", "choice", "json_object")
SO_SCHEMA_TYPES = {"json": "json", "regex": "regex", "ebnf": "grammar"}
_SO_KEYS = {"schema_type", "schema", "trigger_token_ids", "bound_token_id"}
_SO_REFUSED = ("serialized", "bound_token_ids")


@dataclass(frozen=True)
class GrammarSpec:
    kind: str                               # one of KINDS
    source: str                             # JSON schema text, regex, EBNF, JSON list of choices; "" for json_object
    trigger_token_ids: tuple[int, ...] = ()  # so_args: free tokens until this sequence appears
    bound_token_id: int | None = None       # so_args: after it, the rest of the trigger is forced

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.source

    @property
    def choices(self) -> list[str]:
        assert self.kind == "choice"
        return json.loads(self.source)


def as_grammar_spec(structured_outputs: Any, so_args: Any) -> GrammarSpec | None:
    """The spec of a request from its two optional fields (at most one may be given)."""
    if structured_outputs is not None and so_args is not None:
        raise ValueError("structured_outputs and so_args are two spellings of one constraint: give one of them")
    if isinstance(structured_outputs, GrammarSpec):
        return structured_outputs
    if structured_outputs is not None:
        return from_structured_outputs(structured_outputs)
    if so_args is not None:
        return from_so_args(so_args)
    return None


def from_structured_outputs(value: Any) -> GrammarSpec:
    if not isinstance(value, dict):
        raise ValueError(f"structured_outputs must be a dict with one of {', '.join(KINDS)}, "
                         f"got {type(value).__name__}")
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(given) - set(KINDS))
    if unknown:
        raise ValueError(f"structured_outputs: unknown key {unknown[0]!r} (expected one of {', '.join(KINDS)})")
    if len(given) != 1:
        raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}, got {sorted(given) or 'none'}")
    kind, payload = next(iter(given.items()))
    return GrammarSpec(kind, _source(kind, payload, f"structured_outputs.{kind}"))


def from_so_args(value: Any) -> GrammarSpec:
    if not isinstance(value, dict):
        raise ValueError(f"so_args must be a dict, got {type(value).__name__}")
    for key in _SO_REFUSED:
        if key in value:
            raise ValueError(f"so_args: the {key!r} key is not supported")
    unknown = sorted(set(value) - _SO_KEYS)
    if unknown:
        raise ValueError(f"so_args: unknown key {unknown[0]!r} (expected {', '.join(sorted(_SO_KEYS))})")
    schema_type = value.get("schema_type")
    if schema_type not in SO_SCHEMA_TYPES:
        raise ValueError(f"so_args: schema_type must be one of {', '.join(SO_SCHEMA_TYPES)}, got {schema_type!r}")
    schema = value.get("schema")
    if not isinstance(schema, str):
        raise ValueError(f"so_args: schema must be a str, got {type(schema).__name__}")
    kind = SO_SCHEMA_TYPES[schema_type]
    triggers = _token_ids(value.get("trigger_token_ids"), "so_args: trigger_token_ids")
    bound = value.get("bound_token_id")
    if bound is not None:
        bound = _token_ids([bound], "so_args: bound_token_id")[0]
        if not triggers:
            raise ValueError("so_args: bound_token_id requires non-empty trigger_token_ids")
    return GrammarSpec(kind, _source(kind, schema, "so_args: schema"), triggers, bound)


def _source(kind: str, payload: Any, field: str) -> str:
    if kind == "json":
        return _json_schema_text(payload, field)
    if kind in ("regex", "grammar"):
        if not isinstance(payload, str) or not payload:
            raise ValueError(f"{field} must be a non-empty str, got {payload!r}")
        return payload
    if kind == "choice":
        if (not isinstance(payload, (list, tuple)) or not payload
                or not all(isinstance(c, str) and c for c in payload)):
            raise ValueError(f"{field} must be a non-empty list of non-empty str, got {payload!r}")
        return json.dumps(list(payload), ensure_ascii=False)
    if payload is not True:
        raise ValueError(f"{field} must be True, got {payload!r}")
    return ""


def _json_schema_text(schema: Any, field: str) -> str:
    """Compact JSON text of a schema given as a dict or a str. Key order is kept: it is the output's order."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"{field} is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"{field} must be a JSON schema (an object), got {type(schema).__name__}")
    try:
        return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{field} is not JSON-serialisable: {e}") from None


def _token_ids(ids: Any, field: str) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"{field} must be a list of int, got {type(ids).__name__}")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
            raise ValueError(f"{field} must hold ints >= 0, got {t!r}")
    return tuple(int(t) for t in ids)
