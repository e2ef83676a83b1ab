"""`deepserve serve --speculative-config`: a real server speculating with prompt lookup streams the same text it
returns whole, and exports the spec-decode counters."""

from __future__ import annotations

import json

import openai
import pytest
from serving_harness import MODEL_NAME, running_server, scrape_metrics, wait_until_idle


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    with running_server(["--speculative-config", spec], tmp_path_factory.mktemp("spec_server")) as server:
        yield server


def test_streamed_text_equals_whole_text_and_counters_move(spec_server):
    client = openai.OpenAI(base_url=spec_server.base_url + "/v1", api_key="unused")
    messages = [{"role": "user", "content": "Repeat exactly: red green blue yellow red green blue yellow red green"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=32, temperature=0)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=32, temperature=0,
                                            stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == whole.choices[0].message.content
    metrics = wait_until_idle(spec_server.base_url)
    assert metrics["deepserve:spec_decode_num_accepted_tokens_total"] > 0
    assert (metrics["deepserve:spec_decode_num_verified_tokens_total"]
            > metrics["deepserve:spec_decode_num_steps_total"] > 0)
    assert scrape_metrics(spec_server.base_url)["deepserve:kv_cache_free_blocks"] > 0
