"""HTTP request fields -> SamplingParams, refusing what the engine cannot honour yet.

OpenAI's defaults apply where a field is absent (temperature 1, top_p 1, ...). SamplingParams validates
every value and names the field in its ValueError; that becomes a 400 with `param` set.
"""

from __future__ import annotations

from deepserve.sampling_params import SamplingParams
from deepserve.serving.openai.errors import OpenAIError, bad_request, not_supported
from deepserve.serving.openai.protocol import SamplingRequest
from deepserve.serving.openai.structured import request_structured_outputs
from deepserve.structured.spec import GrammarSpec

_PARAM_NAMES = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "seed", "max_tokens", "min_tokens", "stop_token_ids", "stop", "ignore_eos",
                "logprobs", "prompt_logprobs", "skip_special_tokens")


def reject_unsupported(request: SamplingRequest) -> None:
    """Fail loudly (400) on features the engine does not have, rather than silently ignoring them."""
    if request.logit_bias:
        raise not_supported("logit_bias", "logit_bias")


def build_sampling_params(request: SamplingRequest, max_tokens: int | None, logprobs: int | None = None,
                          prompt_logprobs: int | None = None,
                          structured_outputs: GrammarSpec | None = None) -> SamplingParams:
    """`structured_outputs`: a constraint the endpoint derived itself (forced tool calls); without it, the
    request's response_format / structured_outputs / guided_* fields decide."""
    if structured_outputs is None:
        structured_outputs = request_structured_outputs(request)
    top_k = request.top_k if request.top_k is not None else 0
    try:
        return SamplingParams(
            n=request.n,
            temperature=_or(request.temperature, 1.0),
            top_p=_or(request.top_p, 1.0),
            top_k=top_k,
            min_p=_or(request.min_p, 0.0),
            presence_penalty=_or(request.presence_penalty, 0.0),
            frequency_penalty=_or(request.frequency_penalty, 0.0),
            repetition_penalty=_or(request.repetition_penalty, 1.0),
            seed=request.seed,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=request.skip_special_tokens,
            structured_outputs=structured_outputs,
        )
    except ValueError as error:
        raise bad_request(str(error), _param_named_in(str(error))) from None


def check_context_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                         param: str = "max_tokens", prompt_param: str | None = None) -> None:
    """Refuse (400) a request that cannot fit the context window, as vLLM does, instead of truncating it.

    `param` names the max-tokens field in the message; the error's `param` is `prompt_param` when given (chat:
    "messages", for either overflow), else "prompt" for a prompt too long and `param` for too many tokens asked.
    """
    if num_prompt_tokens >= max_model_len:
        raise OpenAIError(400, f"this model's maximum context length is {max_model_len} tokens, but the prompt "
                               f"has {num_prompt_tokens} tokens, which leaves no room to generate",
                          param=prompt_param or "prompt", code="context_length_exceeded")
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise OpenAIError(400, f"this model's maximum context length is {max_model_len} tokens, but "
                               f"{num_prompt_tokens} prompt tokens + {param}={max_tokens} is "
                               f"{num_prompt_tokens + max_tokens}", param=prompt_param or param,
                          code="context_length_exceeded")


def stop_strings(request: SamplingRequest) -> list[str]:
    if request.stop is None:
        return []
    return [request.stop] if isinstance(request.stop, str) else list(request.stop)


def _or(value, default):
    return default if value is None else value


def _param_named_in(message: str) -> str | None:
    first_word = message.split(" ", 1)[0].rstrip(":")
    return first_word if first_word in _PARAM_NAMES else None
