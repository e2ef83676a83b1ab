"""Tool calls in generated text -> OpenAI `tool_calls`.

Hermes-style templates (Hermes, Qwen2.5/Qwen3, many fine-tunes) ask the model to answer a call as
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
one block per call, optionally after some plain text. The parser is chosen from the chat template (it
mentions `<tool_call>`) unless the server is told which one to use.

Invariant: parsing never loses text. If any block is not a JSON object with a string `name`, the whole
output is returned as plain content with no calls, as the model did not follow the format.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from deepserve.serving.openai.options import TOOL_CALL_PARSERS
from deepserve.serving.openai.protocol import ToolCall, ToolCallFunction


@dataclass
class ExtractedToolCalls:
    content: str | None                 # text before the first call (None when empty and there are calls)
    calls: list[ToolCall] = field(default_factory=list)


class HermesToolParser:
    name = "hermes"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"
    # A block runs to its end marker, or to the end of the text when generation stopped inside it.
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def extract(self, text: str) -> ExtractedToolCalls:
        start = text.find(self.start_marker)
        if start == -1:
            return ExtractedToolCalls(text)
        calls = []
        for body in self._block.findall(text, start):
            call = _parse_call(body)
            if call is None:
                return ExtractedToolCalls(text)
            calls.append(call)
        content = text[:start]
        return ExtractedToolCalls(content if content.strip() else None, calls)


def tool_parser_for(name: str, chat_template: str | None) -> HermesToolParser | None:
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {name!r}")
    if name == "hermes" or (name == "auto" and chat_template and HermesToolParser.start_marker in chat_template):
        return HermesToolParser()
    return None


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _parse_call(body: str) -> ToolCall | None:
    try:
        payload = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    arguments = payload.get("arguments", payload.get("parameters", {}))
    # OpenAI sends arguments as a JSON string; models write an object (or, sometimes, already a string).
    arguments_text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=new_tool_call_id(), function=ToolCallFunction(name=payload["name"], arguments=arguments_text))
