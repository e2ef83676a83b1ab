"""Engine requests for one HTTP request: start them all (or none), wait for their final outputs, and turn
engine exceptions into OpenAI errors.

Invariant: every stream `start_requests` returns is closed by the caller (`close_all`) on every path;
closing an unfinished stream aborts its request, so no HTTP request leaves work behind in the engine.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from starlette.requests import Request

from deepserve.engine.async_engine import (
    EngineDeadError,
    EngineShutdownError,
    QueueFullError,
    RequestAbortedError,
    RequestStream,
)
from deepserve.outputs import RequestOutput
from deepserve.sampling_params import SamplingParams
from deepserve.serving.openai.context import ServerContext
from deepserve.serving.openai.errors import OpenAIError, bad_request, error_body
from deepserve.serving.openai.prompts import EnginePrompt
from deepserve.serving.openai.streaming import (
    ClientDisconnected,
    first_completed,
    merge_streams,
    wait_for_disconnect,
)

# Prompts x n per HTTP request; keeps one request from flooding the engine.
MAX_CHOICES_PER_REQUEST = 128


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_num_choices(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_CHOICES_PER_REQUEST:
        raise bad_request(f"{num_prompts} prompts x n={n} asks for {num_prompts * n} completions; at most "
                          f"{MAX_CHOICES_PER_REQUEST} per request", "n")


async def start_requests(ctx: ServerContext, request_id: str, prompts: Sequence[EnginePrompt],
                         params: SamplingParams) -> list[RequestStream]:
    """Add one engine request per prompt; on any failure abort the ones already added and raise an OpenAIError."""
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            engine_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            streams.append(await ctx.engine.add_request(engine_id, prompt.for_engine(), params))
    except BaseException as error:
        await close_all(streams)
        mapped = engine_error(error)
        if mapped is None:
            raise
        raise mapped from None
    return streams


async def close_all(streams: Sequence[RequestStream]) -> None:
    for stream in streams:
        await stream.aclose()


async def final_outputs(request: Request, streams: Sequence[RequestStream]) -> list[RequestOutput] | None:
    """The finished output of each stream, or None if the client disconnected first (requests aborted)."""
    async def collect() -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for index, output in merge_streams(streams):
            if output.finished:
                finals[index] = output
        return [check_output(out) for out in finals]

    try:
        return await first_completed(collect(), wait_for_disconnect(request.receive))
    except ClientDisconnected:
        return None
    except Exception as error:
        mapped = engine_error(error)
        if mapped is None:
            raise
        raise mapped from None
    finally:
        await close_all(streams)


def check_output(output: RequestOutput | None) -> RequestOutput:
    if output is None:
        raise OpenAIError(500, "the engine ended a request without a final output")
    if output.error:
        raise bad_request(output.error, "prompt")
    return output


def engine_error(error: BaseException) -> OpenAIError | None:
    """The OpenAI error for an exception from the engine front; None when it is not one of its errors."""
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, ValueError):
        message = str(error)
        head = message.split(":", 1)[0]
        return bad_request(message, head if head.isidentifier() else None)
    if isinstance(error, QueueFullError):
        return OpenAIError(503, str(error), code="queue_full", headers={"Retry-After": "1"})
    if isinstance(error, (EngineShutdownError, EngineDeadError)):
        return OpenAIError(503, str(error), code="unavailable")
    if isinstance(error, RequestAbortedError):
        return OpenAIError(503, str(error), code="aborted")
    return None


def stream_error_event(error: BaseException) -> dict:
    """The SSE payload sent when a stream fails after its response started (status already 200)."""
    mapped = engine_error(error) or OpenAIError(500, f"internal server error: {type(error).__name__}")
    return error_body(mapped.message, mapped.error_type, mapped.param, mapped.code)
