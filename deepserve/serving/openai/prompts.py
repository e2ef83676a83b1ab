"""Request prompts -> engine prompts (text + token ids), tokenized here, off the engine thread.

Tokenizing in the HTTP front lets the server check the context length (a 400 naming the field) before the
request reaches the engine, and keeps that work out of the engine loop. The engine re-validates the ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deepserve.serving.openai.errors import bad_request
from deepserve.serving.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ToolDefinition,
)


@dataclass
class EnginePrompt:
    text: str | None
    token_ids: list[int]

    def for_engine(self) -> dict[str, Any]:
        return {"prompt": self.text, "prompt_token_ids": self.token_ids}


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]], tokenizer,
                       vocab_size: int) -> list[EnginePrompt]:
    """OpenAI's four prompt shapes: a string, strings, token ids, lists of token ids."""
    if isinstance(prompt, str):
        return [_from_text(prompt, tokenizer)]
    if not prompt:
        raise bad_request("prompt must not be an empty list", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return [_from_text(p, tokenizer) for p in prompt]
    if all(isinstance(p, int) for p in prompt):
        return [_from_ids(prompt, vocab_size)]
    return [_from_ids(p, vocab_size) for p in prompt]


def chat_prompt(request: ChatCompletionRequest, tokenizer) -> EnginePrompt:
    text = render_chat(request.messages, tokenizer, request.add_generation_prompt, request.tools,
                       request.chat_template_kwargs)
    # The template already holds any BOS the model wants; do not add another.
    return EnginePrompt(text, tokenizer.encode(text, add_special_tokens=False))


def render_chat(messages: list[ChatMessage], tokenizer, add_generation_prompt: bool = True,
                tools: list[ToolDefinition] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
    conversation = [message_for_template(m, i) for i, m in enumerate(messages)]
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    reserved = {"messages", "tools", "add_generation_prompt"} & set(template_kwargs or {})
    if reserved:
        raise bad_request(f"chat_template_kwargs must not set {', '.join(sorted(reserved))}", "chat_template_kwargs")
    try:
        return tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                             tools=tool_dicts, **(template_kwargs or {}))
    except ValueError as error:
        raise bad_request(str(error), "messages") from None


def message_for_template(message: ChatMessage, index: int) -> dict[str, Any]:
    """A message as chat templates expect it: `content` a string, tool calls with their arguments."""
    rendered = message.model_dump(exclude_none=True)
    rendered["content"] = message_text(message, index)
    if message.tool_calls:
        rendered["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    return rendered


def message_text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise bad_request(f"messages.{index}.content.{j}: only text parts are supported, got {part.type!r}",
                              f"messages.{index}.content")
        texts.append(part.text)
    return "".join(texts)


def _from_text(text: str, tokenizer) -> EnginePrompt:
    if tokenizer is None:
        raise bad_request("this server has no tokenizer: send the prompt as token ids", "prompt")
    return EnginePrompt(text, tokenizer.encode(text))


def _from_ids(ids: Any, vocab_size: int) -> EnginePrompt:
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of "
                          "lists of token ids", "prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "prompt")
    return EnginePrompt(None, list(ids))
