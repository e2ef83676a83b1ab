"""The asyncio engine front in both of its drivers (tiny random Llama, token-id prompts): AsyncLLMEngine (the engine
on a thread) and EngineProcessClient (the engine in a spawned process, the server's default).

Every await is bounded by asyncio.wait_for, so a bug shows as a failure, never as a hung suite. The process driver
shares one engine process over the tests that do not stop it (spawning one costs ~1-2 s).
"""

from __future__ import annotations

import asyncio
import multiprocessing

import pytest

from deepserve import EngineArgs, SamplingParams
from deepserve.engine.async_engine import (
    AsyncEngineFront,
    AsyncLLMEngine,
    EngineShutdownError,
    QueueFullError,
    RequestAbortedError,
)
from deepserve.engine.engine import LLMEngine
from deepserve.engine.engine_client import EngineProcessClient

TIMEOUT_S = 60
PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


def tiny_args(path: str) -> EngineArgs:
    return EngineArgs(model=path, skip_tokenizer_init=True, dtype="float32", block_size=8, max_model_len=128)


@pytest.fixture(scope="module")
def shared_process_engine(tiny_llama):
    engine = EngineProcessClient(tiny_args(tiny_llama))
    yield engine
    asyncio.run(engine.shutdown(drain=False))
    assert not engine.process.is_alive()


@pytest.fixture(params=["thread", "process"])
def mode(request) -> str:
    return request.param


@pytest.fixture()
def engine(mode, tiny_llama, request):
    """A running front: the thread driver's own engine, or the module's shared engine process."""
    if mode == "thread":
        front = AsyncLLMEngine(LLMEngine.from_engine_args(tiny_args(tiny_llama)))
        yield front
        if front.is_running:
            asyncio.run(front.shutdown(drain=False))
    else:
        front = request.getfixturevalue("shared_process_engine")
        yield front
        front.max_waiting = None
        assert front.num_waiting == 0


def own_engine(mode: str, path: str, **kwargs) -> AsyncEngineFront:
    """A front of its own (for tests that stop it)."""
    if mode == "thread":
        return AsyncLLMEngine(LLMEngine.from_engine_args(tiny_args(path)), **kwargs)
    return EngineProcessClient(tiny_args(path), **kwargs)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def collect(engine: AsyncEngineFront, request_id: str, params: SamplingParams, prompt=PROMPT) -> list:
    return [out async for out in engine.generate(request_id, prompt, params)]


async def wait_all_blocks_free(engine: AsyncEngineFront) -> None:
    """Until the engine's stats show no request and every KV block free (the wait_for around the test bounds it)."""
    while (engine.stats.num_free_blocks != engine.stats.num_blocks or engine.stats.num_running
           or engine.stats.num_waiting):
        await asyncio.sleep(0.01)


def assert_engine_idle(engine: AsyncEngineFront) -> None:
    assert engine.stats.num_running == engine.stats.num_waiting == 0
    assert engine.stats.num_free_blocks == engine.stats.num_blocks
    if isinstance(engine, AsyncLLMEngine):
        assert not engine.engine.has_unfinished_requests()


def test_generate_streams_cumulative_outputs_until_finished(engine):
    async def main():
        return await collect(engine, "a", greedy(6))
    outputs = run(main())
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    assert lengths == sorted(lengths) and lengths[-1] == 6
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert outputs[-1].prompt_token_ids == PROMPT["prompt_token_ids"]
    assert outputs[-1].outputs[0].finish_reason == "length"


def test_concurrent_requests_match_sequential_ones(engine):
    async def main():
        prompts = [{"prompt_token_ids": [3 + i, 9, 11 + i]} for i in range(4)]
        together = await asyncio.gather(*(collect(engine, f"c{i}", greedy(5), p) for i, p in enumerate(prompts)))
        alone = [await collect(engine, f"s{i}", greedy(5), p) for i, p in enumerate(prompts)]
        return together, alone
    together, alone = run(main())
    assert [t[-1].outputs[0].token_ids for t in together] == [a[-1].outputs[0].token_ids for a in alone]
    assert len({tuple(a[-1].outputs[0].token_ids) for a in alone}) > 1     # the prompts do lead apart


def test_both_drivers_give_the_same_tokens(tiny_llama, shared_process_engine):
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=8, n=2, logprobs=2, ignore_eos=True)

    async def main(front):
        return (await collect(front, "same", params))[-1]
    thread_front = own_engine("thread", tiny_llama)
    by_thread = run(main(thread_front))
    run(thread_front.shutdown())
    by_process = run(main(shared_process_engine))
    for a, b in zip(by_thread.outputs, by_process.outputs, strict=True):
        assert a.token_ids == b.token_ids and len(b.token_ids) == 8
        assert [sorted(e) for e in a.logprobs] == [sorted(e) for e in b.logprobs]
        assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob)


def test_bad_input_raises_value_error_and_the_engine_keeps_serving(engine):
    async def main():
        with pytest.raises(ValueError, match="empty"):
            await collect(engine, "bad", greedy(2), {"prompt_token_ids": []})
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await collect(engine, "bad", greedy(2), {"prompt_token_ids": [10**6]})
        with pytest.raises(ValueError, match="already in use"):
            await asyncio.gather(collect(engine, "dup", greedy(3)), collect(engine, "dup", greedy(3)))
        outputs = await collect(engine, "good", greedy(3))
        await wait_all_blocks_free(engine)
        return outputs
    outputs = run(main())
    assert outputs[-1].finished and engine.num_waiting == 0


def test_closing_the_stream_early_aborts_and_frees_blocks(engine):
    async def main():
        stream = engine.generate("leaver", PROMPT, greedy(100))
        first = await stream.__anext__()
        await stream.aclose()
        await wait_all_blocks_free(engine)
        return first
    first = run(main())
    assert not first.finished
    assert_engine_idle(engine)


def test_cancelling_the_reader_aborts_the_request(engine):
    async def main():
        reader = asyncio.ensure_future(collect(engine, "cancelled", greedy(100)))
        while engine.stats.num_running == 0:
            await asyncio.sleep(0.01)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        await wait_all_blocks_free(engine)
    run(main())
    assert_engine_idle(engine)


def test_abort_ends_the_stream_with_request_aborted(engine):
    async def main():
        stream = await engine.add_request("x", PROMPT, greedy(100))
        await stream.__anext__()
        engine.abort("x")
        with pytest.raises(RequestAbortedError):
            async for _ in stream:
                pass
        await wait_all_blocks_free(engine)
        # The id is free again at once; the aborted request's late outputs never reach the new one.
        return await collect(engine, "x", greedy(3))
    again = run(main())
    assert [len(o.outputs[0].token_ids) for o in again][-1] == 3
    assert_engine_idle(engine)


def test_queue_limit_refuses_requests_waiting_to_be_scheduled(engine):
    engine.max_waiting = 1

    async def main():
        first, second = engine.generate("1", PROMPT, greedy(3)), engine.generate("2", PROMPT, greedy(3))
        # Both are admitted in the same event-loop turn, before the first can have been scheduled.
        results = await asyncio.gather(first.__anext__(), second.__anext__(), return_exceptions=True)
        await first.aclose()
        later = await collect(engine, "3", greedy(2))     # the queue is free again
        return results, later
    results, later = run(main())
    assert not isinstance(results[0], Exception)
    assert isinstance(results[1], QueueFullError)
    assert later[-1].finished and engine.num_waiting == 0


def test_shutdown_drains_in_flight_requests_then_refuses_new_ones(mode, tiny_llama):
    engine = own_engine(mode, tiny_llama)

    async def main():
        reader = asyncio.ensure_future(collect(engine, "inflight", greedy(12)))
        while engine.stats.num_running == 0:
            await asyncio.sleep(0.01)
        await engine.shutdown(drain=True)
        outputs = await reader
        with pytest.raises(EngineShutdownError):
            await collect(engine, "late", greedy(2))
        return outputs
    outputs = run(main())
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 12
    assert not engine.is_running
    if mode == "process":
        assert not engine.process.is_alive() and engine.process.exitcode == 0
        assert engine.process not in multiprocessing.active_children()


def test_shutdown_without_drain_ends_streams_with_an_error(mode, tiny_llama):
    engine = own_engine(mode, tiny_llama)

    async def main():
        reader = asyncio.ensure_future(collect(engine, "dropped", greedy(100)))
        while engine.stats.num_running == 0:
            await asyncio.sleep(0.01)
        await engine.shutdown(drain=False)
        with pytest.raises(EngineShutdownError, match="without draining"):
            await reader
    run(main())
    if mode == "thread":
        assert engine.engine.block_manager.num_free_blocks == engine.engine.block_manager.num_blocks
    else:
        assert not engine.process.is_alive() and engine.process.exitcode == 0


def test_engine_built_on_the_engine_thread_and_load_errors_raised(tiny_llama):
    args = tiny_args(tiny_llama)

    async def main():
        engine = AsyncLLMEngine(lambda: LLMEngine.from_engine_args(args))
        outputs = await collect(engine, "built", greedy(3))
        await engine.shutdown()
        return outputs
    assert run(main())[-1].finished

    def broken() -> LLMEngine:
        raise FileNotFoundError("no such model")
    with pytest.raises(FileNotFoundError, match="no such model"):
        AsyncLLMEngine(broken)
