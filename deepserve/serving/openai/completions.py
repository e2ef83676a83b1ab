"""POST /v1/completions: one engine request per prompt, n choices each; plain JSON or SSE.

Choice `index` = prompt_index * n + output_index (OpenAI's numbering for a list of prompts).
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
    check_num_choices,
    close_all,
    final_outputs,
    new_request_id,
    start_requests,
    stream_error_event,
)
from deepserve.serving.openai.errors import not_supported
from deepserve.serving.openai.logprobs import completion_logprobs
from deepserve.serving.openai.prompts import EnginePrompt, completion_prompts
from deepserve.serving.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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
    merge_streams,
    sse_event,
)


class CompletionsEndpoint:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    async def create(self, body: CompletionRequest, request: Request) -> CompletionResponse | Response:
        ctx = self.ctx
        model = ctx.check_model(body.model)
        _reject_unsupported(body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        prompts = completion_prompts(body.prompt, ctx.engine.tokenizer, ctx.engine.engine.vocab_size)
        check_num_choices(len(prompts), body.n)
        for prompt in prompts:
            check_context_length(len(prompt.token_ids), max_tokens, ctx.max_model_len)
        # Echo with logprobs reports the prompt's logprobs too, as OpenAI does.
        prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
        params = build_sampling_params(body, max_tokens, body.logprobs, prompt_logprobs)
        response = _ResponseBuilder(ctx, body, model, new_request_id("cmpl"), prompts)
        streams = await start_requests(ctx, response.id, prompts, params)
        if body.stream:
            return EventStreamResponse(response.events(streams))
        finals = await final_outputs(request, streams)
        if finals is None:
            return Response(status_code=499)    # the client left; its requests were aborted
        return response.full(finals)


def _reject_unsupported(body: CompletionRequest) -> None:
    reject_unsupported(body)
    if body.suffix:
        raise not_supported("suffix", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise not_supported("best_of different from n", "best_of")


class _ResponseBuilder:
    """Builds the JSON answer or the SSE chunks for one completion request."""

    def __init__(self, ctx: ServerContext, body: CompletionRequest, model: str, request_id: str,
                 prompts: list[EnginePrompt]) -> None:
        self.ctx = ctx
        self.body = body
        self.model = model
        self.id = request_id
        self.prompts = prompts
        self.created = int(time.time())

    # --- non-streaming ---------------------------------------------------------------------------
    def full(self, finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for prompt_index, output in enumerate(finals):
            for c in output.outputs:
                echo = self._echo_text(prompt_index) if self.body.echo else ""
                choices.append(CompletionChoice(
                    index=prompt_index * self.body.n + c.index, text=echo + c.text,
                    logprobs=self._logprobs(output, c, echo=self.body.echo, start=0),
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        choices.sort(key=lambda choice: choice.index)
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  usage=self._usage(finals))

    # --- streaming -------------------------------------------------------------------------------
    async def events(self, streams: list[RequestStream]) -> AsyncIterator[bytes]:
        body = self.body
        trackers: dict[int, DeltaTracker] = {}
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for prompt_index, output in merge_streams(streams):
                if output.finished:
                    finals[prompt_index] = output
                for c in output.outputs:
                    index = prompt_index * body.n + c.index
                    tracker = trackers.setdefault(index, DeltaTracker(stop_strings(body)))
                    chunk = self._chunk(prompt_index, index, output, c, tracker)
                    if chunk is not None:
                        yield sse_event(chunk)
            if body.stream_options is not None and body.stream_options.include_usage:
                yield sse_event(self._envelope([], usage=self._usage(finals).model_dump()))
        except Exception as error:  # noqa: BLE001 - the status is already 200: report in-band, then end
            yield sse_event(stream_error_event(error))
        finally:
            await close_all(streams)
        yield SSE_DONE

    def _chunk(self, prompt_index: int, index: int, output: RequestOutput, c: CompletionOutput,
               tracker: DeltaTracker) -> dict | None:
        finished = c.finish_reason is not None
        first = tracker.sent_tokens == 0 and tracker.sent_chars == 0
        start = tracker.sent_tokens
        text = tracker.text_delta(c.text, finished)
        tracker.new_tokens(len(c.token_ids))
        has_new_logprobs = self.body.logprobs is not None and tracker.sent_tokens > start
        if not text and not finished and not has_new_logprobs:
            return None     # a prefill chunk, or text held back (a possible stop string)
        echo = first and self.body.echo
        prefix = self._echo_text(prompt_index) if echo else ""
        logprobs = self._logprobs(output, c, echo=echo, start=start, end=tracker.sent_tokens,
                                  text_offset=0 if echo else tracker.sent_chars - len(text))
        choice = {"index": index, "text": prefix + text,
                  "logprobs": logprobs.model_dump() if logprobs is not None else None,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason if finished else None}
        return self._envelope([choice])

    def _envelope(self, choices: list[dict], usage: dict | None = None) -> dict:
        chunk = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                 "choices": choices}
        if self.body.stream_options is not None and self.body.stream_options.include_usage:
            chunk["usage"] = usage
        return chunk

    # --- shared ----------------------------------------------------------------------------------
    def _echo_text(self, prompt_index: int) -> str:
        prompt = self.prompts[prompt_index]
        if prompt.text is not None:
            return prompt.text
        return self.ctx.engine.tokenizer.decode(prompt.token_ids) if self.ctx.engine.tokenizer else ""

    def _logprobs(self, output: RequestOutput, c: CompletionOutput, echo: bool, start: int,
                  end: int | None = None, text_offset: int = 0) -> CompletionLogprobs | None:
        top_n = self.body.logprobs
        if top_n is None or c.logprobs is None:
            return None
        end = len(c.token_ids) if end is None else end
        token_ids, entries = list(c.token_ids[start:end]), list(c.logprobs[start:end])
        if echo and output.prompt_logprobs is not None:
            token_ids = list(output.prompt_token_ids) + token_ids
            entries = list(output.prompt_logprobs[:len(output.prompt_token_ids)]) + entries
        return completion_logprobs(token_ids, entries, top_n, self.ctx.engine.tokenizer, text_offset)

    def _usage(self, finals: list[RequestOutput | None]) -> UsageInfo:
        prompt_tokens = sum(len(p.token_ids) for p in self.prompts)
        completion_tokens = sum(len(c.token_ids) for out in finals if out is not None for c in out.outputs)
        cached = sum(out.num_cached_tokens for out in finals if out is not None)
        return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                         total_tokens=prompt_tokens + completion_tokens,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

