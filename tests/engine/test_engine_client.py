"""EngineProcessClient: the engine in a spawned process (engine/engine_process.py) behind the asyncio front.

The front-end/engine split is checked against the offline engine on the default model (the text the client
detokenizes, and the text the engine cuts at a stop string, must be the offline engine's), and the process's
life: its load errors, its death, its shutdown. The driver-independent behaviour (ordering, aborts freeing
blocks, queue limits, drains) is in tests/serving/test_async_engine.py, run over both drivers.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from deepserve import EngineArgs, SamplingParams
from deepserve.engine.async_engine import EngineDeadError
from deepserve.engine.engine import LLMEngine
from deepserve.engine.engine_client import EngineProcessClient

TIMEOUT_S = 60
PROMPTS = ["The capital of France is", "Write a haiku about the sea:"]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


async def final(engine: EngineProcessClient, request_id: str, prompt, params: SamplingParams):
    outputs = [out async for out in engine.generate(request_id, prompt, params)]
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    return outputs[-1]


@pytest.fixture(scope="module")
def default_engine(default_model_path):
    engine = EngineProcessClient(EngineArgs(model=default_model_path, max_model_len=512, seed=0))
    yield engine
    run(engine.shutdown())
    assert not engine.process.is_alive()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=16),
    # Stop strings: the engine detokenizes these itself and cuts the text, here back into text it had already
    # reported (each stop spans several tokens): the client must take the cut.
    SamplingParams(temperature=0.0, max_tokens=20, stop=[" Paris.", "The sun rises"]),
    SamplingParams(temperature=0.0, max_tokens=12, skip_special_tokens=False, logprobs=1),
], ids=["seeded-n2", "stop", "special-logprobs"])
def test_text_and_tokens_are_the_offline_engines(default_engine, smollm, params):
    async def main():
        return await asyncio.gather(*(final(default_engine, f"t{i}", p, params) for i, p in enumerate(PROMPTS)))
    served = run(main())
    offline = smollm.generate(PROMPTS, params, use_tqdm=False)
    for got, want in zip(served, offline, strict=True):
        assert got.prompt_token_ids == want.prompt_token_ids
        assert [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in got.outputs] == \
               [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in want.outputs]
        if params.logprobs is not None:
            assert [sorted(e) for e in got.outputs[0].logprobs] == [sorted(e) for e in want.outputs[0].logprobs]
    if params.stop:
        assert [o.outputs[0].stop_reason for o in served] == params.stop
        assert [o.outputs[0].text for o in served] == ["", "\n\n"]


def test_streamed_texts_only_grow_without_a_stop_string(default_engine):
    async def main():
        params = SamplingParams(temperature=0.0, max_tokens=24)
        return [o.outputs[0].text async for o in default_engine.generate("grow", PROMPTS[0], params)]
    texts = run(main())
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and texts[-1]


def test_load_errors_come_back_from_the_child(tmp_path):
    (tmp_path / "config.json").write_text("{}")       # a directory that is no checkpoint
    args = EngineArgs(model=str(tmp_path), skip_tokenizer_init=True)
    with pytest.raises(Exception) as in_process:
        LLMEngine.from_engine_args(args)
    with pytest.raises(type(in_process.value)) as spawned:
        EngineProcessClient(args)
    assert str(spawned.value) == str(in_process.value)


def test_a_killed_engine_process_fails_open_streams_and_new_requests(tiny_llama):
    engine = EngineProcessClient(EngineArgs(model=tiny_llama, skip_tokenizer_init=True, dtype="float32",
                                            block_size=8, max_model_len=128))
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)

    async def main():
        stream = await engine.add_request("victim", {"prompt_token_ids": [5, 6, 7]}, params)
        await stream.__anext__()
        os.kill(engine.process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="died"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await engine.add_request("late", {"prompt_token_ids": [5]}, params)
        await engine.shutdown()      # returns at once: there is no loop left to stop
    run(main())
    assert not engine.is_running and not engine.process.is_alive()
    assert engine.process.exitcode == -signal.SIGKILL
