"""POST /v1/chat/completions: render the messages with the model's chat template, generate n choices,
and turn Hermes-style `<tool_call>` blocks into OpenAI `tool_calls` when the request offers tools.
With tool_choice="required" or a named function the output is constrained to the call(s) as JSON
(serving/openai/structured.py) and always answered as `tool_calls`; streamed, each call's name comes first
and then its arguments as string deltas, as OpenAI sends them.

Streaming sends, per choice: a first delta with the role, content deltas, and a last delta with the tool
calls (if any) and the finish reason. Content stops streaming at the start of a tool call, and a tail that
could be the start of `<tool_call>` (or of a stop string) is held back until it is decided.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from deepserve.engine.async_engine import RequestStream
from deepserve.outputs import CompletionOutput, RequestOutput
from deepserve.serving.openai.context import ServerContext
from deepserve.serving.openai.dispatch import (
    close_all,
    final_outputs,
    new_request_id,
    start_requests,
    stream_error_event,
)
from deepserve.serving.openai.errors import bad_request
from deepserve.serving.openai.logprobs import chat_logprobs
from deepserve.serving.openai.prompts import chat_prompt, message_text
from deepserve.serving.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    PromptTokensDetails,
    UsageInfo,
)
from deepserve.serving.openai.sampling import (
    build_sampling_params,
    check_context_length,
    reject_unsupported,
    stop_strings,
)
from deepserve.serving.openai.streaming import (
    SSE_DONE,
    DeltaTracker,
    EventStreamResponse,
    sse_event,
)
from deepserve.serving.openai.structured import (
    ForcedToolCalls,
    forced_tool_calls,
    request_structured_outputs,
)
from deepserve.serving.openai.tool_parsers import (
    ExtractedToolCalls,
    HermesToolParser,
    new_tool_call_id,
)


class ChatEndpoint:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def create(self, body: ChatCompletionRequest, request: Request) -> ChatCompletionResponse | Response:
        ctx = self.ctx
        model = ctx.check_model(body.model)
        _reject_unsupported(body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        prompt = chat_prompt(body, ctx.tokenizer)
        # As OpenAI does, chat names `messages` whichever side overflows the context.
        check_context_length(len(prompt.token_ids), max_tokens, ctx.max_model_len, param, prompt_param="messages")
        top_n = (body.top_logprobs or 0) if body.logprobs else None
        forced = _forced_tool_calls(body)
        params = build_sampling_params(body, max_tokens, top_n, structured_outputs=forced.spec if forced else None)
        builder = _ChatResponseBuilder(ctx, body, model, new_request_id("chatcmpl"), len(prompt.token_ids), forced)
        streams = await start_requests(ctx, builder.id, [prompt], params)
        if body.stream:
            return EventStreamResponse(builder.events(streams[0]))
        finals = await final_outputs(request, streams)
        if finals is None:
            return Response(status_code=499)    # the client left; its request was aborted
        return builder.full(finals[0])


def _reject_unsupported(body: ChatCompletionRequest) -> None:
    reject_unsupported(body)


def _forced_tool_calls(body: ChatCompletionRequest) -> ForcedToolCalls | None:
    forced = forced_tool_calls(body)
    if forced is not None and request_structured_outputs(body) is not None:
        raise bad_request("a forced tool call (tool_choice) already constrains the output: drop response_format "
                          "or the structured-output fields", "tool_choice")
    return forced


class _ChatResponseBuilder:
    def __init__(self, ctx: ServerContext, body: ChatCompletionRequest, model: str, request_id: str,
                 num_prompt_tokens: int, forced: ForcedToolCalls | None = None) -> None:
        self.ctx = ctx
        self.body = body
        self.model = model
        self.id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.created = int(time.time())
        self.forced = forced
        self._sent_calls: dict[int, list[int]] = {}     # forced calls: choice -> argument chars sent, per call
        uses_tools = bool(body.tools) and body.tool_choice != "none" and forced is None
        self.tool_parser: HermesToolParser | None = ctx.tool_parser if uses_tools else None
        self.echo = _echo_text(body)

    # --- non-streaming ---------------------------------------------------------------------------
    def full(self, output: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for c in output.outputs:
            if self.forced is not None:
                choices.append(self._forced_choice(c))
                continue
            parsed = self._parse(c.text)
            content = parsed.content if parsed.calls else self.echo + c.text
            message = ChatResponseMessage(content=content, tool_calls=parsed.calls)
            choices.append(ChatChoice(index=c.index, message=message, logprobs=self._logprobs(c, 0, None),
                                      finish_reason=self._finish_reason(c, parsed), stop_reason=c.stop_reason))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=self._usage(output))

    # --- streaming -------------------------------------------------------------------------------
    async def events(self, stream: RequestStream) -> AsyncIterator[bytes]:
        markers = stop_strings(self.body) + ([self.tool_parser.start_marker] if self.tool_parser else [])
        trackers = {i: DeltaTracker(markers) for i in range(self.body.n)}
        final: RequestOutput | None = None
        try:
            for i in range(self.body.n):
                delta = {"role": "assistant", "content": self.echo}
                yield sse_event(self._envelope([_choice(i, delta)]))
            async for output in stream:
                final = output if output.finished else final
                for c in output.outputs:
                    chunk = self._chunk(c, trackers[c.index])
                    if chunk is not None:
                        yield sse_event(chunk)
            if self.body.stream_options is not None and self.body.stream_options.include_usage:
                yield sse_event(self._envelope([], usage=self._usage(final).model_dump()))
        except Exception as error:  # noqa: BLE001 - the status is already 200: report in-band, then end
            yield sse_event(stream_error_event(error))
        finally:
            await close_all([stream])
        yield SSE_DONE

    def _chunk(self, c: CompletionOutput, tracker: DeltaTracker) -> dict | None:
        if self.forced is not None:
            return self._forced_chunk(c, tracker)
        finished = c.finish_reason is not None
        start = tracker.sent_tokens
        visible = self._streamable_text(c.text, finished)
        text = tracker.text_delta(visible, finished or len(visible) < len(c.text))
        tracker.new_tokens(len(c.token_ids))
        delta: dict = {"content": text} if text else {}
        parsed = None
        if finished:
            parsed = self._parse(c.text)
            if parsed.calls:
                delta["tool_calls"] = [{"index": k, **call.model_dump()} for k, call in enumerate(parsed.calls)]
            else:
                # The text was not a well-formed tool call after all: send what was held back.
                rest = c.text[tracker.sent_chars:]
                tracker.sent_chars = len(c.text)
                if rest:
                    delta["content"] = delta.get("content", "") + rest
        if not delta and not finished and not (self.body.logprobs and tracker.sent_tokens > start):
            return None     # text held back (a possible stop string or tool call) and no logprobs to send
        logprobs = self._logprobs(c, start, tracker.sent_tokens)
        choice = _choice(c.index, delta, logprobs.model_dump() if logprobs is not None else None,
                         self._finish_reason(c, parsed) if finished else None)
        if finished:
            choice["stop_reason"] = c.stop_reason
        return self._envelope([choice])

    # --- forced tool calls (tool_choice "required" or named) -------------------------------------
    def _forced_choice(self, c: CompletionOutput) -> ChatChoice:
        message = ChatResponseMessage(content=None, tool_calls=self.forced.calls(c.text))
        return ChatChoice(index=c.index, message=message, logprobs=self._logprobs(c, 0, None),
                          finish_reason=_forced_finish_reason(c), stop_reason=c.stop_reason)

    def _forced_chunk(self, c: CompletionOutput, tracker: DeltaTracker) -> dict | None:
        """Tool-call deltas: a call's first delta has its index, id, type and name; later ones add arguments."""
        finished = c.finish_reason is not None
        start = tracker.sent_tokens
        tracker.new_tokens(len(c.token_ids))
        sent = self._sent_calls.setdefault(c.index, [])
        deltas = []
        for k, (name, arguments) in enumerate(self.forced.partial_calls(c.text)):
            if k == len(sent):
                sent.append(0)
                deltas.append({"index": k, "id": new_tool_call_id(), "type": "function",
                               "function": {"name": name, "arguments": ""}})
            if len(arguments) > sent[k]:
                deltas.append({"index": k, "function": {"arguments": arguments[sent[k]:]}})
                sent[k] = len(arguments)
        if not deltas and not finished:
            return None
        logprobs = self._logprobs(c, start, tracker.sent_tokens)
        choice = _choice(c.index, {"tool_calls": deltas} if deltas else {},
                         logprobs.model_dump() if logprobs is not None else None,
                         _forced_finish_reason(c) if finished else None)
        return self._envelope([choice])

    def _streamable_text(self, text: str, finished: bool) -> str:
        """The part of the text that is content: all of it, or what comes before a tool call."""
        if self.tool_parser is None:
            return text
        start = text.find(self.tool_parser.start_marker)
        return text if start == -1 else text[:start]

    def _envelope(self, choices: list[dict], usage: dict | None = None) -> dict:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                 "choices": choices}
        if self.body.stream_options is not None and self.body.stream_options.include_usage:
            chunk["usage"] = usage
        return chunk

    # --- shared ----------------------------------------------------------------------------------
    def _parse(self, text: str) -> ExtractedToolCalls:
        if self.tool_parser is None:
            return ExtractedToolCalls(text)
        return self.tool_parser.extract(text)

    def _finish_reason(self, c: CompletionOutput, parsed: ExtractedToolCalls | None) -> str | None:
        if parsed is not None and parsed.calls:
            return "tool_calls"
        return c.finish_reason

    def _logprobs(self, c: CompletionOutput, start: int, end: int | None) -> ChatLogprobs | None:
        if not self.body.logprobs or c.logprobs is None:
            return None
        end = len(c.token_ids) if end is None else end
        content = chat_logprobs(c.token_ids[start:end], c.logprobs[start:end], self.body.top_logprobs or 0,
                                self.ctx.engine.tokenizer)
        return ChatLogprobs(content=content)

    def _usage(self, output: RequestOutput | None) -> UsageInfo:
        completion = sum(len(c.token_ids) for c in output.outputs) if output is not None else 0
        cached = output.num_cached_tokens if output is not None else 0
        return UsageInfo(prompt_tokens=self.num_prompt_tokens, completion_tokens=completion,
                         total_tokens=self.num_prompt_tokens + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _forced_finish_reason(c: CompletionOutput) -> str | None:
    # A forced call that ended normally is answered as tool calls; "length" or a grammar failure says so.
    return "tool_calls" if c.finish_reason == "stop" else c.finish_reason


def _choice(index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def _echo_text(body: ChatCompletionRequest) -> str:
    """vLLM's chat `echo`: prepend the last message's content when it is the assistant's (a continuation)."""
    last = body.messages[-1]
    if not body.echo or last.role != "assistant":
        return ""
    return message_text(last)

