"""The OpenAI HTTP schema as pydantic models: what clients may send and what the server answers.

Field names and defaults follow OpenAI's API, plus vLLM's sampling extensions (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, skip_special_tokens). Bounds declared here
document the API (and so the served OpenAPI schema); SamplingParams stays the engine's own guard.
Unknown fields are ignored, as OpenAI clients send fields we have no use for (user, metadata, ...).

Requests are validated strictly: pydantic's lax mode reads `false` as the integer 0 (a token id) and `0` as
the boolean false, which OpenAI refuses; in strict mode an integer must be an integer and a boolean a boolean
(a float field still takes an integer). What the server refuses, the schema says (minLength, minItems,
minimum, one message shape per role), so that /openapi.json and the server agree.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

# OpenAI's own cap on n; prompts x n is capped separately (see completions.py).
MAX_N = 128
MAX_LOGPROBS = 20



def _integral_number(value: Any) -> Any:
    # JSON Schema counts 1.0 as an integer, so the schema admits it; strict mode alone would refuse it.
    return int(value) if isinstance(value, float) and value.is_integer() else value


# Bounds go before the validator (and inside `| None`): put after it, pydantic writes them into the schema
# as `ge`/`le`, which JSON Schema does not know, instead of `minimum`/`maximum`.
_INTEGRAL = BeforeValidator(_integral_number)
Integer = Annotated[int, _INTEGRAL]
PositiveInteger = Annotated[int, Field(ge=1), _INTEGRAL]
LogprobsCount = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), _INTEGRAL]
# The vocabulary's size is known only once the model is loaded: the app adds `maximum` where this mark is.
TOKEN_ID_MARK = "x-token-id"
TokenId = Annotated[int, Field(ge=0, json_schema_extra={TOKEN_ID_MARK: True}), _INTEGRAL]
# A stop token id outside the vocabulary is never sampled, so it is harmless and not refused.
StopTokenId = Annotated[int, Field(ge=0), _INTEGRAL]
NonEmptyStr = Annotated[str, Field(min_length=1)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: Integer = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Annotated[int, Field(ge=-1), _INTEGRAL] | None = Field(None, description="-1 or 0 disables top-k")
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: Integer | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StopTokenId] | None = None
    ignore_eos: bool = False
    min_tokens: Integer = Field(0, ge=0)
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # vLLM's structured-output extensions (serving/openai/structured.py): at most one constraint per request.
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(SamplingRequest):
    # A string, strings, token ids, or lists of token ids; the server refuses an empty prompt of any shape.
    prompt: (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    max_tokens: PositiveInteger | None = 16
    max_completion_tokens: PositiveInteger | None = None
    logprobs: LogprobsCount | None = None
    echo: bool = False
    best_of: PositiveInteger | None = None
    suffix: str | None = None


class ToolCallFunction(_Request):
    name: str
    arguments: str


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class TextPart(_Request):
    type: Literal["text"]
    text: str


MessageContent = str | Annotated[list[TextPart], Field(min_length=1)]


class SystemMessage(_Request):
    role: Literal["system"]
    content: MessageContent
    name: str | None = None


class DeveloperMessage(_Request):
    role: Literal["developer"]
    content: MessageContent
    name: str | None = None


class UserMessage(_Request):
    role: Literal["user"]
    content: MessageContent
    name: str | None = None


class AssistantMessage(_Request):
    # The check below, in the schema's words: content that is not null, or at least one tool call.
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}}]})

    role: Literal["assistant"]
    name: str | None = None
    tool_calls: list[ToolCall] | None = None     # before content: content's check reads it
    content: MessageContent | None = Field(None, validate_default=True, description="required without tool_calls")

    @field_validator("content")
    @classmethod
    def _content_or_tool_calls(cls, content: Any, info: ValidationInfo) -> Any:
        if content is None and not info.data.get("tool_calls"):
            raise PydanticCustomError("missing", "an assistant message needs content or tool_calls")
        return content


class ToolMessage(_Request):
    role: Literal["tool"]
    content: MessageContent
    tool_call_id: str


class FunctionMessage(_Request):
    """OpenAI's deprecated predecessor of the tool message."""

    role: Literal["function"]
    content: str | None
    name: str


_MESSAGE_CLASSES = (SystemMessage, DeveloperMessage, UserMessage, AssistantMessage, ToolMessage, FunctionMessage)
# role -> the class's name, read from each class's `role: Literal[...]`.
_TAG_BY_ROLE = {cls.model_fields["role"].annotation.__args__[0]: cls.__name__ for cls in _MESSAGE_CLASSES}
ROLES = tuple(_TAG_BY_ROLE)


def _check_role(message: Any) -> Any:
    """Refuse a non-object, or a missing or unknown role, before the union picks a branch, naming `role`
    (ctx["param"]): the union's own error would name the message and its tag function instead."""
    if isinstance(message, BaseModel):
        return message
    if not isinstance(message, dict):
        raise PydanticCustomError("model_type", "a message must be an object with a role")
    role = message.get("role")
    if role is None:
        raise PydanticCustomError("missing", "field required", {"param": "role"})
    if not isinstance(role, str) or role not in _TAG_BY_ROLE:
        raise PydanticCustomError("literal_error", "Input should be one of {expected}",
                                  {"param": "role", "expected": ", ".join(repr(r) for r in ROLES)})
    return message


def _message_tag(message: Any) -> str | None:
    role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
    return _TAG_BY_ROLE.get(role) if isinstance(role, str) else None


# One shape per role, tagged by class name: a union branch named in an error location is then a capitalized
# word, which errors.py leaves out of the parameter it reports (`messages[0].content`, not `...tool.content`).
ChatMessage = Annotated[
    Annotated[SystemMessage, Tag("SystemMessage")] | Annotated[DeveloperMessage, Tag("DeveloperMessage")]
    | Annotated[UserMessage, Tag("UserMessage")] | Annotated[AssistantMessage, Tag("AssistantMessage")]
    | Annotated[ToolMessage, Tag("ToolMessage")] | Annotated[FunctionMessage, Tag("FunctionMessage")],
    Discriminator(_message_tag), BeforeValidator(_check_role)]


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: PositiveInteger | None = Field(None, description="deprecated by OpenAI: use max_completion_tokens")
    max_completion_tokens: PositiveInteger | None = None
    logprobs: bool = False
    top_logprobs: LogprobsCount | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    echo: bool = Field(False, description="prepend the last message's content when it is the assistant's")
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


# --- responses ----------------------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="prompt tokens read from the prefix cache, not computed")


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "deepserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def _without_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


class TokenizeRequest(_Request):
    """Either `prompt` (plain text) or `messages` (rendered with the chat template first): exactly one.

    Neither may be null, so that the schema's oneOf of `required` says "exactly one" as the server means it.
    """

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})

    model: str | None = None
    prompt: str = Field(None, json_schema_extra=_without_default)      # type: ignore[assignment]
    messages: Annotated[list[ChatMessage], Field(min_length=1)] = Field(  # type: ignore[assignment]
        None, json_schema_extra=_without_default)
    add_special_tokens: bool | None = Field(None, description="default: true for prompt, false for messages")
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class VersionResponse(BaseModel):
    version: str


def bound_token_ids(schema: Any, vocab_size: int) -> None:
    """Give every token id in an OpenAPI schema (marked TOKEN_ID_MARK) its `maximum`: the server refuses ids
    outside the vocabulary, so the schema says so."""
    if isinstance(schema, dict):
        if schema.pop(TOKEN_ID_MARK, False):
            schema["maximum"] = vocab_size - 1
        for value in schema.values():
            bound_token_ids(value, vocab_size)
    elif isinstance(schema, list):
        for value in schema:
            bound_token_ids(value, vocab_size)
