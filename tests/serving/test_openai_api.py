"""The official `openai` client (and raw httpx where the client hides the HTTP) against a live server.

One server for the module: default model, two API keys, a rate limit, a small queue and body limit,
so every error status is produced by a real request.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from serving_harness import MODEL_NAME, running_server, scrape_metrics, wait_until_idle

KEY, OTHER_KEY = "sk-test-key", "sk-other-key"
# Requests/s per key (burst of 25): low, so that the burst test below sees the bucket run dry even when the server
# answers slowly (at 100/s, a 2-core machine busy with other work answered 65/s and never ran out).
RATE_LIMIT = 25
MAX_QUEUE = 4
MAX_BODY = 64 * 1024
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--max-model-len", "512", "--api-key", KEY, "--api-key", OTHER_KEY, "--rate-limit", str(RATE_LIMIT),
            "--max-queue", str(MAX_QUEUE), "--max-body-bytes", str(MAX_BODY), "--seed", "0"]
    # The engine process (the GPU default; the CPU default is the thread, which the other server modules run).
    with running_server(args, tmp_path_factory.mktemp("api_server"), env={"DEEPSERVE_ENGINE_IN_PROCESS": "0"}) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, timeout=60, max_retries=0) as c:
        yield c


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def post(server, path: str, body: dict, key: str | None = KEY, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=auth(key) if key else {}, timeout=timeout)


# --- happy paths ---------------------------------------------------------------------------------

def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_completion_greedy(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    choice = out.choices[0]
    assert "Paris" in choice.text
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_completion_stream_matches_non_stream_and_reports_usage(client):
    full = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_chat_stream_matches_non_stream(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    full = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0)
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_max_completion_tokens_caps_chat(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Count to 50"}],
                                         max_completion_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_n2_gives_two_choices(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Name a color"}],
                                         max_tokens=6, temperature=1.0, seed=3, n=2)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens <= 2 * 6
    stream = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, n=2, seed=3, stream=True)
    assert {c.choices[0].index for c in stream if c.choices} == {0, 1}


def test_stop_string_is_cut_and_never_streamed(client):
    kwargs = {"model": MODEL_NAME, "prompt": "1, 2, 3,", "max_tokens": 16, "temperature": 0, "stop": [" 6"]}
    full = client.completions.create(**kwargs)
    assert full.choices[0].finish_reason == "stop"
    assert " 6" not in full.choices[0].text and "5" in full.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices)
    assert streamed == full.choices[0].text


def test_seed_makes_sampling_reproducible(client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=12,
                                         temperature=1.0, seed=seed).choices[0].text
    assert sample(7) == sample(7)
    assert sample(8) != sample(7) or sample(9) != sample(7)


def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    for own, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert own <= 0 and 1 <= len(top) <= 3
        assert abs(max(top.values()) - own) < 1e-4      # greedy: the chosen token is the most likely


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_echo_prepends_the_prompt_with_its_logprobs(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                                    logprobs=1)
    assert out.choices[0].text.startswith(PROMPT)
    assert out.choices[0].logprobs.token_logprobs[0] is None        # the first prompt token has no logprob
    assert len(out.choices[0].logprobs.tokens) == out.usage.prompt_tokens + 3


def test_token_id_prompts_and_prompt_lists(server, client):
    ids = post(server, "/tokenize", {"prompt": PROMPT}).json()["tokens"]
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, temperature=0)
    listed = client.completions.create(model=MODEL_NAME, prompt=[PROMPT, "1, 2,"], max_tokens=4, temperature=0,
                                       n=2)
    assert [c.index for c in listed.choices] == [0, 1, 2, 3]
    assert listed.choices[0].text == listed.choices[1].text == by_ids.choices[0].text
    assert listed.usage.completion_tokens == 16


def test_penalties_and_sampling_fields_are_accepted(client):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0.8, top_p=0.9,
                                    presence_penalty=0.5, frequency_penalty=0.5, seed=1,
                                    extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                                                "ignore_eos": True})
    assert out.usage.completion_tokens == 4


def test_tokenize_detokenize_roundtrip(server):
    tokens = post(server, "/tokenize", {"prompt": "hello world", "return_token_strs": True}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    text = post(server, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "hello world"
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > tokens["count"]


def test_health_version_metrics_need_no_key(server):
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert httpx.get(server.base_url + "/version").json()["version"]
    metrics = httpx.get(server.base_url + "/metrics")
    assert metrics.status_code == 200 and "deepserve:num_requests_running" in metrics.text


def test_cors_is_off_by_default(server):
    preflight = httpx.options(server.base_url + "/v1/models", headers={
        "Origin": "https://app.example.com", "Access-Control-Request-Method": "GET"})
    assert preflight.status_code != 200
    simple = httpx.get(server.base_url + "/v1/models", headers={**auth(), "Origin": "https://app.example.com"})
    assert simple.status_code == 200 and "access-control-allow-origin" not in simple.headers


# --- errors ----------------------------------------------------------------------------------------

def test_auth_accepted_and_refused(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=OTHER_KEY, max_retries=0) as other:
        assert other.models.list().data[0].id == MODEL_NAME
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="sk-wrong", max_retries=0) as wrong, \
            pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    missing = httpx.get(server.base_url + "/v1/models")
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "missing_api_key"
    # Refused before the body is even parsed: a bad body without a key is still a 401.
    assert httpx.post(server.base_url + "/v1/completions", content=b"{not json").status_code == 401


def test_bad_field_is_400_naming_it(client, server):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, temperature=-1)
    assert info.value.body["param"] == "temperature"
    bad_role = post(server, "/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]})
    assert bad_role.status_code == 400 and bad_role.json()["error"]["param"] == "messages[0].role"
    too_long = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10_000})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_tokens"
    bad_ids = post(server, "/v1/completions", {"prompt": [1, 2, 10_000_000]})
    assert bad_ids.status_code == 400 and bad_ids.json()["error"]["param"] == "prompt"
    not_json = httpx.post(server.base_url + "/v1/completions", content=b"{oops", headers=auth())
    assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "invalid_request_error"


def test_unsupported_features_are_refused_not_ignored(server):
    # response_format and forced tool calls are served now (tests/serving/test_structured_outputs.py).
    response = post(server, "/v1/completions", {"prompt": PROMPT, "logit_bias": {"50": 5}})
    assert response.status_code == 400
    assert "not supported yet" in response.json()["error"]["message"]


def test_tools_are_rendered_and_accepted(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Weather?"}],
                                         tools=tools, max_tokens=4, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt=PROMPT, max_tokens=2)
    assert info.value.body["code"] == "model_not_found"


def test_body_too_large_is_413(server):
    big = {"prompt": "x" * (MAX_BODY + 1)}
    response = post(server, "/v1/completions", big)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"
    # Without a Content-Length (chunked upload) the body is counted as it arrives.
    chunks = iter([b'{"prompt": "', b"y" * MAX_BODY, b'"}'])
    chunked = httpx.post(server.base_url + "/v1/completions", content=chunks,
                         headers={**auth(), "Content-Type": "application/json"}, timeout=60)
    assert chunked.status_code == 413


def test_rate_limit_is_429_with_retry_after(server):
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, headers=auth(OTHER_KEY), timeout=30) as c:
            # Far over the burst, so that even a slow (loaded) server sees the bucket run dry.
            return await asyncio.gather(*(c.get("/v1/models") for _ in range(4 * RATE_LIMIT)))
    responses = asyncio.run(burst())
    limited = [r for r in responses if r.status_code == 429]
    assert limited, "no request was rate limited"
    assert all(r.status_code in (200, 429) for r in responses)
    assert int(limited[0].headers["Retry-After"]) >= 1
    assert limited[0].json()["error"]["type"] == "rate_limit_error"
    time.sleep(2)       # let the bucket refill for the tests after this one


def test_queue_full_is_503(server):
    body = {"prompt": PROMPT * 20, "max_tokens": 2, "temperature": 0}

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, headers=auth(), timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(4 * MAX_QUEUE)))
    responses = asyncio.run(flood())
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 503}, statuses
    assert 503 in statuses and 200 in statuses
    full = next(r for r in responses if r.status_code == 503)
    assert full.json()["error"]["code"] == "queue_full" and full.headers["Retry-After"] == "1"
    wait_until_idle(server.base_url)


# --- disconnects ---------------------------------------------------------------------------------------

def _generated_tokens(server) -> float:
    return scrape_metrics(server.base_url)["deepserve:generation_tokens_total"]


def test_stream_disconnect_aborts_and_frees_blocks(server):
    before = _generated_tokens(server)
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=auth(), timeout=60) as r:
        lines = r.iter_lines()
        received = 0
        for line in lines:
            if line.startswith("data:"):
                received += 1
            if received >= 3:
                break                       # leave mid-stream: the connection is closed here
    metrics = wait_until_idle(server.base_url)
    assert metrics["deepserve:num_requests_running"] == 0
    assert metrics["deepserve:kv_cache_free_blocks"] == metrics["deepserve:kv_cache_total_blocks"]
    assert metrics["deepserve:generation_tokens_total"] - before < 400     # it stopped early


def test_non_stream_disconnect_aborts_and_frees_blocks(server):
    before = _generated_tokens(server)
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, headers=auth(), timeout=1.5)
    metrics = wait_until_idle(server.base_url)
    assert metrics["deepserve:kv_cache_free_blocks"] == metrics["deepserve:kv_cache_total_blocks"]
    assert metrics["deepserve:generation_tokens_total"] - before < 400
