"""Structured outputs in the OpenAI API: request fields -> SamplingParams.structured_outputs, and forced tool calls.

Where a constraint comes from (at most one per request, else a 400 naming both):
- `response_format`: {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema",
  "strict"}} (the schema is always enforced, strict or not);
- vLLM's extra body: `structured_outputs` ({"json" | "regex" | "choice" | "grammar" | "json_object": ...}) or
  the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`;
- chat `tool_choice="required"` or a named function: the output is the call(s) themselves, as JSON
  constrained to the tools' parameter schemas (`ForcedToolCalls`).

Forced tool calls are generated as plain JSON (no `<tool_call>` markers): a named function's output is its
arguments object; "required" produces `[{"name": ..., "arguments": {...}}, ...]` (one call when
parallel_tool_calls is false). The grammar fixes the key order, so `partial_calls` can cut streamed text into
(name, arguments-so-far) pairs: streamed argument deltas add up to exactly the non-streamed arguments.
"""

from __future__ import annotations

import json
import re
from typing import Any

from deepserve.serving.openai.errors import bad_request
from deepserve.serving.openai.protocol import (
    ChatCompletionRequest,
    NamedToolChoice,
    SamplingRequest,
    ToolCall,
    ToolCallFunction,
)
from deepserve.serving.openai.tool_parsers import new_tool_call_id
from deepserve.structured.spec import GrammarSpec, from_structured_outputs

_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def request_structured_outputs(request: SamplingRequest) -> GrammarSpec | None:
    """The request's constraint from response_format / structured_outputs / guided_*; 400 naming the field."""
    sources = {}
    fmt = request.response_format
    if fmt is not None and fmt.type != "text":
        sources["response_format"] = _from_response_format(fmt.type, fmt.json_schema)
    if request.structured_outputs is not None:
        sources["structured_outputs"] = request.structured_outputs
    for name, kind in _GUIDED_FIELDS.items():
        value = getattr(request, name)
        if value is not None:
            sources[name] = {kind: value}
    if len(sources) > 1:
        raise bad_request(f"give one structured-output constraint, got {', '.join(sources)}", sorted(sources)[1])
    if not sources:
        return None
    (field, value), = sources.items()
    return _spec(value, field)


def _from_response_format(kind: str, json_schema: dict[str, Any] | None) -> dict[str, Any]:
    if kind == "json_object":
        return {"json_object": True}
    if not isinstance(json_schema, dict) or "schema" not in json_schema:
        raise bad_request("response_format json_schema needs json_schema.schema (the JSON schema)", "response_format")
    return {"json": json_schema["schema"]}


def _spec(value: Any, field: str) -> GrammarSpec:
    try:
        return from_structured_outputs(value)
    except ValueError as error:
        raise bad_request(str(error), field) from None


class ForcedToolCalls:
    """tool_choice="required" or {"type": "function", "function": {"name": ...}}: the output is the call(s)."""

    def __init__(self, body: ChatCompletionRequest) -> None:
        tools = {t.function.name: t.function.parameters or {"type": "object"} for t in body.tools or []}
        if not tools:
            raise bad_request("tool_choice forces a tool call but the request has no tools", "tool_choice")
        self.named = body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None
        if self.named is not None and self.named not in tools:
            raise bad_request(f"tool_choice names {self.named!r}, which is not among the tools", "tool_choice")
        schema = tools[self.named] if self.named is not None else _calls_schema(tools, body.parallel_tool_calls)
        self.spec = _spec({"json": schema}, "tools")

    def partial_calls(self, text: str) -> list[tuple[str, str]]:
        """(name, arguments text so far) of each call begun in `text`; a prefix of the final pairs."""
        return [(self.named, text)] if self.named is not None else partial_calls(text)

    def calls(self, text: str) -> list[ToolCall]:
        return [ToolCall(id=new_tool_call_id(), function=ToolCallFunction(name=name, arguments=args))
                for name, args in self.partial_calls(text)]


def forced_tool_calls(body: ChatCompletionRequest) -> ForcedToolCalls | None:
    if body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice):
        return ForcedToolCalls(body)
    return None


def _calls_schema(tools: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    call = {"anyOf": [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                         "arguments": params},
                       "required": ["name", "arguments"]} for name, params in tools.items()]}
    schema: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


# `{"name": "<name>", "arguments": ` at the start of a call (after "[" or ", "), whitespace-tolerant.
_CALL_HEAD = re.compile(r'\s*,?\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_CALL_TAIL = re.compile(r"\s*\}")


def partial_calls(text: str) -> list[tuple[str, str]]:
    """Calls of a (possibly unfinished) `[{"name": ..., "arguments": ...}, ...]` text, in order."""
    start = text.find("[")
    if start == -1:
        return []
    calls, pos = [], start + 1
    while (head := _CALL_HEAD.match(text, pos)) is not None:
        name = json.loads(f'"{head.group(1)}"')
        end = json_value_end(text, head.end())
        if end is None:
            calls.append((name, text[head.end():]))
            break
        calls.append((name, text[head.end():end]))
        tail = _CALL_TAIL.match(text, end)
        if tail is None:
            break
        pos = tail.end()
    return calls


def json_value_end(text: str, start: int) -> int | None:
    """Index just past the JSON object or array that starts at `start`, None if it is not complete yet."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None
