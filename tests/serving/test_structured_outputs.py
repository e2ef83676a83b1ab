"""Structured outputs through the official `openai` client against a live server: response_format (a pydantic
model through `beta.chat.completions.parse`, a json_schema dict, json_object), vLLM's extra-body fields, forced
tool calls (named and "required", streamed as OpenAI streams them) and bad schemas as OpenAI-style 400s."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from serving_harness import MODEL_NAME, running_server

CITIES = ["Paris", "London", "Tokyo"]
WEATHER = {"type": "object", "properties": {"city": {"enum": CITIES}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a zone", "parameters": TIME}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Forecast(BaseModel):
    city: Literal["Paris", "London", "Tokyo"]
    temperature_c: int = Field(ge=-40, le=50)
    sunny: bool


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # One OpenMP thread: the CPU is shared with other jobs, and two spinning threads slow small steps down.
    with running_server(["--max-model-len", "1024", "--seed", "0"], tmp_path_factory.mktemp("so_server"),
                        env={"OMP_NUM_THREADS": "1"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=120, max_retries=0) as c:
        yield c


def test_parse_with_a_pydantic_model(client):
    done = client.beta.chat.completions.parse(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Give a weather forecast for a city."}],
        response_format=Forecast, temperature=0.8, seed=1, max_tokens=64)
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Forecast)
    assert choice.message.parsed == Forecast.model_validate_json(choice.message.content)


def test_response_format_json_schema_and_json_object(client):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}, "sure": {"type": "boolean"}},
              "required": ["answer", "sure"]}
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "What is 2+2? Answer in JSON."}], temperature=0,
        max_tokens=48, response_format={"type": "json_schema",
                                        "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    value = json.loads(out.choices[0].message.content)
    assert set(value) == {"answer", "sure"} and isinstance(value["answer"], int) and isinstance(value["sure"], bool)
    obj = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": 'Reply with a short JSON object like {"ok": true}.'}],
        temperature=0, max_tokens=48, response_format={"type": "json_object"})
    text = obj.choices[0].message.content
    assert obj.choices[0].finish_reason == "stop", text
    assert isinstance(json.loads(text), dict)


def test_vllm_extra_body_fields_on_completions(client):
    choices = ["yes", "no", "maybe"]
    picked = client.completions.create(model=MODEL_NAME, prompt="Is the sky blue? Answer:", max_tokens=8,
                                       temperature=1.0, seed=2, n=4, extra_body={"guided_choice": choices})
    assert all(c.text in choices and c.finish_reason == "stop" for c in picked.choices)
    code = client.completions.create(model=MODEL_NAME, prompt="A postcode:", max_tokens=12, temperature=0,
                                     extra_body={"structured_outputs": {"regex": "[A-Z]{2}[0-9]{2}"}})
    assert re.fullmatch("[A-Z]{2}[0-9]{2}", code.choices[0].text)
    streamed = client.completions.create(model=MODEL_NAME, prompt="A postcode:", max_tokens=12, temperature=0,
                                         stream=True, extra_body={"guided_regex": "[A-Z]{2}[0-9]{2}"})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == code.choices[0].text


def test_a_named_tool_choice_returns_that_call(client):
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, temperature=0, max_tokens=48,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert args["city"] in CITIES and args["unit"] in ("celsius", "fahrenheit")


def accumulate_tool_calls(chunks) -> tuple[dict[int, dict], list[str | None]]:
    """What an OpenAI client does with streamed tool calls: the first delta of an index carries id and name,
    the later ones pieces of the arguments string."""
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasons.append(chunk.choices[0].finish_reason)
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.function.name and tc.type == "function"
                calls[tc.index] = {"name": tc.function.name, "arguments": tc.function.arguments or ""}
            else:
                assert tc.id is None and not tc.function.name
                calls[tc.index]["arguments"] += tc.function.arguments or ""
        assert not delta.content
    return calls, reasons


def test_required_tool_calls_stream_as_argument_deltas(client):
    request = {"model": MODEL_NAME, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 0,
               "max_tokens": 96, "parallel_tool_calls": False}
    full = client.chat.completions.create(**request)
    assert full.choices[0].finish_reason == "tool_calls"
    (call,) = full.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert args["city"] in CITIES
    else:
        assert re.fullmatch("[A-Z]{3}", args["zone"])
    calls, reasons = accumulate_tool_calls(client.chat.completions.create(**request, stream=True))
    assert calls == {0: {"name": call.function.name, "arguments": call.function.arguments}}
    assert reasons[-1] == "tool_calls" and sum(r is not None for r in reasons) == 1


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json={"model": MODEL_NAME, **body}, timeout=60)


def test_bad_schemas_are_openai_style_400s(server):
    bad_schema = post(server, "/v1/chat/completions", {
        "messages": ASK, "response_format": {"type": "json_schema",
                                             "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}})
    assert bad_schema.status_code == 400
    error = bad_schema.json()["error"]
    assert error["type"] == "invalid_request_error" and "invalid JSON schema" in error["message"]
    no_schema = post(server, "/v1/completions", {"prompt": "x", "response_format": {"type": "json_schema",
                                                                                     "json_schema": {"name": "x"}}})
    assert no_schema.status_code == 400 and no_schema.json()["error"]["param"] == "response_format"
    bad_regex = post(server, "/v1/completions", {"prompt": "x", "guided_regex": "(unclosed"})
    assert bad_regex.status_code == 400 and "invalid regex" in bad_regex.json()["error"]["message"]
    two = post(server, "/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["a"]})
    assert two.status_code == 400 and "one structured-output constraint" in two.json()["error"]["message"]
    unknown_tool = post(server, "/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}})
    assert unknown_tool.status_code == 400 and unknown_tool.json()["error"]["param"] == "tool_choice"
    streamed = post(server, "/v1/chat/completions", {"messages": ASK, "stream": True, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}})
    assert streamed.status_code == 400           # refused before the stream starts
