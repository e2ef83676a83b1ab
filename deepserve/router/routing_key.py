"""What the router reads of a request body: the text to match prefixes on, whether it streams, and a guess
of the tokens it will hold on a replica. The body itself is forwarded byte for byte; validating it is the
replica's job (the router must not disagree with the server about what is valid).

The text of a chat request is its messages in order (role and content), so turns of one conversation share
the prefix of the earlier turns, as their chat-templated prompts do on the replica. Token-id prompts become
text of their ids ("1,2,3,"), whose prefixes are the id sequences' prefixes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Characters per token for the load guess: about 4 for English BPE vocabularies.
_CHARS_PER_TOKEN = 4
_DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class RoutedRequest:
    path: str
    body: bytes
    method: str = "POST"
    text: str = ""
    stream: bool = False
    tokens: int = 0            # prompt + completion budget, a guess (for token load)


def routed_request(path: str, body: bytes, method: str = "POST") -> RoutedRequest:
    if not body:
        return RoutedRequest(path, body, method)
    try:
        payload = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        payload = None
    if not isinstance(payload, dict):
        # Not ours to refuse: the replica answers it with the server's own 400.
        return RoutedRequest(path, body, method, text=body[:4096].decode("utf-8", "replace"))
    text = prompt_text(payload)
    budget = payload.get("max_completion_tokens") or payload.get("max_tokens") or _DEFAULT_MAX_TOKENS
    budget = budget if isinstance(budget, int) and budget > 0 else _DEFAULT_MAX_TOKENS
    return RoutedRequest(path, body, method, text=text, stream=payload.get("stream") is True,
                         tokens=len(text) // _CHARS_PER_TOKEN + budget)


def prompt_text(payload: dict[str, Any]) -> str:
    if "messages" in payload:
        return messages_text(payload["messages"])
    return prompt_value_text(payload.get("prompt", ""))


def messages_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    parts = []
    for message in messages:
        if isinstance(message, dict):
            parts.append(f"<{message.get('role', '')}>{content_text(message.get('content'))}")
    return "".join(parts)


def content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):          # content parts: the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def prompt_value_text(prompt: Any) -> str:
    """A completions prompt: a string, a list of strings (routed by the first), token ids or lists of them."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):
            return "".join(f"{t}," for t in prompt)
        return prompt_value_text(first)
    return ""
