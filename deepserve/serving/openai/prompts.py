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
    """OpenAI's four prompt shapes (a string, strings, token ids, lists of token ids), non-empty and with
    integer ids >= 0 already (the schema checks them); the ids are checked against the vocabulary here."""
    if isinstance(prompt, str):
        return [_from_text(prompt, tokenizer)]
    if isinstance(prompt[0], str):
        return [_from_text(p, tokenizer) for p in prompt]
    if isinstance(prompt[0], int):
        return [_from_ids(prompt, vocab_size)]
    return [_from_ids(p, vocab_size) for p in prompt]


def chat_prompt(request: ChatCompletionRequest, tokenizer) -> EnginePrompt:
    text = render_chat(request.messages, tokenizer, request.add_generation_prompt, request.tools,
                       request.chat_template_kwargs)
    # The template already holds any BOS the model wants; do not add another.
    return EnginePrompt(text, tokenizer.encode(text, add_special_tokens=False))


def render_chat(messages: list[ChatMessage], tokenizer, add_generation_prompt: bool = True,
                tools: list[ToolDefinition] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
    conversation = [message_for_template(m) for m in messages]
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    reserved = {"messages", "tools", "add_generation_prompt"} & set(template_kwargs or {})
    if reserved:
        raise bad_request(f"chat_template_kwargs must not set {', '.join(sorted(reserved))}", "chat_template_kwargs")
    try:
        return tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                             tools=tool_dicts, **(template_kwargs or {}))
    except ValueError as error:
        raise bad_request(str(error), "messages") from None


def message_for_template(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates expect it: `content` a string (text parts joined), tool calls included."""
    rendered = message.model_dump(exclude_none=True)
    rendered["content"] = message_text(message)
    return rendered


def message_text(message: ChatMessage) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)      # the schema admits text parts only


def _from_text(text: str, tokenizer) -> EnginePrompt:
    if tokenizer is None:
        raise bad_request("this server has no tokenizer: send the prompt as token ids", "prompt")
    return EnginePrompt(text, tokenizer.encode(text))


def _from_ids(ids: list[int], vocab_size: int) -> EnginePrompt:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "prompt")
    return EnginePrompt(None, list(ids))
