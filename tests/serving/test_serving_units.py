"""Pure parts of the server, without a server: deltas and stop-string hold-back, tool-call parsing,
rate limiting, error naming, model naming, stream merging, and the benchmark's statistics."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from deepserve.bench.serve import latency_stats, parse_goodput, percentile
from deepserve.outputs import CompletionOutput
from deepserve.serving.openai.chat import _ChatResponseBuilder
from deepserve.serving.openai.context import ServerConfig, default_model_name
from deepserve.serving.openai.errors import validation_error
from deepserve.serving.openai.protocol import ChatCompletionRequest, CompletionRequest
from deepserve.serving.openai.rate_limit import RateLimiter, retry_after_header
from deepserve.serving.openai.streaming import (
    DeltaTracker,
    merge_streams,
    partial_marker_len,
)
from deepserve.serving.openai.tool_parsers import HermesToolParser, tool_parser_for

# --- stop strings never leak into a stream --------------------------------------------------------


@pytest.mark.parametrize("text, markers, expected", [
    ("hello wor", ["world"], 3), ("hello", ["world"], 0), ("abc<tool", ["<tool_call>"], 5),
    ("x", [], 0), ("aaa", ["aab", "a"], 2), ("end\n", ["\n\n"], 1),
])
def test_partial_marker_len(text, markers, expected):
    assert partial_marker_len(text, markers) == expected


def _engine_texts(generated: str, stops: list[str]) -> list[tuple[str, bool]]:
    """What the engine reports step by step: cumulative text; a matched stop string is cut and ends it."""
    steps = []
    for k in range(1, len(generated) + 1):
        text = generated[:k]
        hits = [i for i in (text.find(s) for s in stops) if i != -1]
        if hits:
            steps.append((text[:min(hits)], True))
            return steps
        steps.append((text, False))
    steps[-1] = (steps[-1][0], True)
    return steps


@settings(max_examples=300, deadline=None)
@given(generated=st.text(alphabet="ab c", min_size=1, max_size=30),
       stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), max_size=3))
def test_streamed_deltas_add_up_to_the_final_text_and_never_show_a_stop_string(generated, stops):
    tracker = DeltaTracker(stops)
    sent = ""
    steps = _engine_texts(generated, stops)
    for text, finished in steps:
        sent += tracker.text_delta(text, finished)
        if not finished:
            assert not any(s in sent for s in stops)
    assert sent == steps[-1][0]


def test_delta_tracker_counts_new_tokens():
    tracker = DeltaTracker()
    assert list(tracker.new_tokens(3)) == [0, 1, 2]
    assert list(tracker.new_tokens(3)) == []
    assert list(tracker.new_tokens(5)) == [3, 4]


# --- tool calls --------------------------------------------------------------------------------------

def test_hermes_parser_extracts_calls_and_keeps_leading_content():
    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_call>{"name": "now", "arguments": {}}</tool_call>')
    parsed = HermesToolParser().extract(text)
    assert parsed.content == "Let me check."
    assert [(c.function.name, c.function.arguments) for c in parsed.calls] == [
        ("get_weather", '{"city": "Paris"}'), ("now", "{}")]
    assert all(c.id.startswith("call_") and c.type == "function" for c in parsed.calls)


@pytest.mark.parametrize("text", ["no calls at all", "<tool_call>{not json}</tool_call>",
                                  '<tool_call>{"arguments": {}}</tool_call>', "<tool_call>[1, 2]</tool_call>"])
def test_hermes_parser_never_loses_text(text):
    parsed = HermesToolParser().extract(text)
    assert parsed.calls == [] and parsed.content == text


def test_hermes_parser_accepts_an_unclosed_last_call():
    parsed = HermesToolParser().extract('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}')
    assert parsed.content is None and parsed.calls[0].function.arguments == '{"x": 1}'


def test_tool_parser_is_chosen_from_the_template():
    assert tool_parser_for("auto", "{% if tools %}<tool_call>{% endif %}") is not None
    assert tool_parser_for("auto", "{{ messages }}") is None
    assert tool_parser_for("hermes", None) is not None
    assert tool_parser_for("none", "<tool_call>") is None
    with pytest.raises(ValueError, match="tool_call_parser"):
        tool_parser_for("pythonic", None)


def _chat_builder(stream_body: dict) -> _ChatResponseBuilder:
    ctx = SimpleNamespace(tool_parser=HermesToolParser(), engine=SimpleNamespace(tokenizer=None))
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], stream=True, **stream_body,
                                 tools=[{"type": "function", "function": {"name": "f"}}])
    return _ChatResponseBuilder(ctx, body, "m", "chatcmpl-1", 3)


def test_streamed_tool_calls_never_show_the_markup():
    builder = _chat_builder({})
    full = 'Sure.<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    tracker = DeltaTracker([HermesToolParser.start_marker])
    chunks = []
    for k in range(1, len(full) + 1):
        finished = k == len(full)
        output = CompletionOutput(0, full[:k], list(range(k)), None, None, "stop" if finished else None)
        chunk = builder._chunk(output, tracker)
        if chunk is not None:
            chunks.append(chunk["choices"][0])
    content = "".join(c["delta"].get("content", "") for c in chunks)
    assert content == "Sure."
    calls = [call for c in chunks for call in c["delta"].get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [(0, "f", '{"a": 1}')]
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_malformed_tool_call_is_streamed_as_content_at_the_end():
    builder = _chat_builder({})
    full = "Hm <tool_call>oops"
    tracker = DeltaTracker([HermesToolParser.start_marker])
    content = ""
    for k in range(1, len(full) + 1):
        finished = k == len(full)
        output = CompletionOutput(0, full[:k], list(range(k)), None, None, "stop" if finished else None)
        chunk = builder._chunk(output, tracker)
        if chunk is not None:
            content += chunk["choices"][0]["delta"].get("content", "")
    assert content == full


# --- rate limiting -----------------------------------------------------------------------------------

def test_token_bucket_allows_a_burst_then_the_rate():
    now = [0.0]
    limiter = RateLimiter(rate=2.0, clock=lambda: now[0])
    assert [limiter.acquire("k") for _ in range(2)] == [0.0, 0.0]       # burst of one second's worth
    wait = limiter.acquire("k")
    assert wait == pytest.approx(0.5)
    assert retry_after_header(wait) == "1"
    assert limiter.acquire("other") == 0.0                                # buckets are per client
    now[0] += 0.5
    assert limiter.acquire("k") == 0.0
    assert limiter.acquire("k") > 0


def test_rate_limiter_refuses_a_non_positive_rate():
    with pytest.raises(ValueError, match="rate"):
        RateLimiter(rate=0)


# --- errors, config, names ---------------------------------------------------------------------------

@pytest.mark.parametrize("cls, body, param", [
    (CompletionRequest, {"prompt": "x", "temperature": "hot"}, "temperature"),
    (CompletionRequest, {}, "prompt"),
    (CompletionRequest, {"prompt": {"a": 1}}, "prompt"),
    (ChatCompletionRequest, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"},
     "tool_choice"),
    (ChatCompletionRequest, {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    (CompletionRequest, {"prompt": [[False]]}, "prompt[0][0]"),
])
def test_validation_errors_name_the_field(cls, body, param):
    with pytest.raises(ValidationError) as info:
        cls.model_validate(body)
    error = validation_error(info.value.errors())
    assert error.status_code == 400 and error.param == param
    assert error.message.startswith(param)


def test_server_config_is_validated():
    for bad in ({"rate_limit": 0}, {"max_queue": -1}, {"max_body_bytes": 0}, {"api_keys": [""]}):
        with pytest.raises(ValueError):
            ServerConfig(**bad)


@pytest.mark.parametrize("path, name", [
    ("/x/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"), ("/x/model-f16.gguf", "model-f16"),
    ("/models/Qwen3-0.6B/", "Qwen3-0.6B"), ("/x/tiny.F16.gguf", "tiny"),
])
def test_default_model_name(path, name):
    assert default_model_name(path) == name


def test_merge_streams_interleaves_and_tags_by_index():
    async def numbers(start: int, count: int):
        for i in range(start, start + count):
            await asyncio.sleep(0)
            yield i

    async def main():
        return [item async for item in merge_streams([numbers(0, 3), numbers(10, 2)])]
    merged = asyncio.run(main())
    assert sorted(merged) == [(0, 0), (0, 1), (0, 2), (1, 10), (1, 11)]
    assert [v for i, v in merged if i == 0] == [0, 1, 2]


# --- benchmark statistics ----------------------------------------------------------------------------

def test_percentiles_interpolate_like_numpy():
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile([5.0], 99) == 5.0
    stats = latency_stats([0.001, 0.002, 0.003])
    assert stats == {"mean": 2.0, "median": 2.0, "p90": 2.8, "p99": 2.98}
    assert latency_stats([])["mean"] is None


def test_goodput_slos_are_parsed():
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    with pytest.raises(ValueError, match="goodput"):
        parse_goodput(["latency:5"])
