"""AsyncLLMEngine: one engine thread behind an asyncio front (tiny random Llama, token-id prompts).

Every await is bounded by asyncio.wait_for, so a bug shows as a failure, never as a hung suite.
"""

from __future__ import annotations

import asyncio

import pytest

from deepserve import EngineArgs, SamplingParams
from deepserve.engine.async_engine import (
    AsyncLLMEngine,
    EngineShutdownError,
    QueueFullError,
    RequestAbortedError,
)
from deepserve.engine.engine import LLMEngine

TIMEOUT_S = 60
PROMPT = {"prompt_token_ids": [5, 6, 7, 8]}


@pytest.fixture()
def llm_engine(tiny_llama):
    args = EngineArgs(model=tiny_llama, skip_tokenizer_init=True, dtype="float32", block_size=8, max_model_len=128)
    return LLMEngine.from_engine_args(args)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


async def collect(engine: AsyncLLMEngine, request_id: str, params: SamplingParams, prompt=PROMPT) -> list:
    return [out async for out in engine.generate(request_id, prompt, params)]


async def wait_all_blocks_free(engine: AsyncLLMEngine) -> None:
    while engine.stats.num_free_blocks != engine.stats.num_blocks or engine.stats.num_running:
        await asyncio.sleep(0.01)


def test_generate_streams_cumulative_outputs_until_finished(llm_engine):
    async def main():
        engine = AsyncLLMEngine(llm_engine)
        outputs = await collect(engine, "a", greedy(6))
        await engine.shutdown()
        return outputs
    outputs = run(main())
    lengths = [len(o.outputs[0].token_ids) for o in outputs]
    assert lengths == sorted(lengths) and lengths[-1] == 6
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]


def test_concurrent_requests_match_sequential_ones(llm_engine):
    async def main():
        engine = AsyncLLMEngine(llm_engine)
        prompts = [{"prompt_token_ids": [3 + i, 9, 11 + i]} for i in range(4)]
        together = await asyncio.gather(*(collect(engine, f"c{i}", greedy(5), p) for i, p in enumerate(prompts)))
        alone = [await collect(engine, f"s{i}", greedy(5), p) for i, p in enumerate(prompts)]
        await engine.shutdown()
        return together, alone
    together, alone = run(main())
    assert [t[-1].outputs[0].token_ids for t in together] == [a[-1].outputs[0].token_ids for a in alone]


def test_bad_input_raises_value_error_and_the_engine_keeps_serving(llm_engine):
    async def main():
        engine = AsyncLLMEngine(llm_engine)
        with pytest.raises(ValueError, match="empty"):
            await collect(engine, "bad", greedy(2), {"prompt_token_ids": []})
        with pytest.raises(ValueError, match="already in use"):
            await asyncio.gather(collect(engine, "dup", greedy(3)), collect(engine, "dup", greedy(3)))
        outputs = await collect(engine, "good", greedy(3))
        await wait_all_blocks_free(engine)
        await engine.shutdown()
        return outputs, engine
    outputs, engine = run(main())
    assert outputs[-1].finished and engine.num_waiting == 0


def test_closing_the_stream_early_aborts_and_frees_blocks(llm_engine):
    async def main():
        engine = AsyncLLMEngine(llm_engine)
        stream = engine.generate("leaver", PROMPT, greedy(100))
        first = await stream.__anext__()
        await stream.aclose()
        await wait_all_blocks_free(engine)
        await engine.shutdown()
        return first
    first = run(main())
    assert not first.finished
    assert not llm_engine.has_unfinished_requests()


def test_cancelling_the_reader_aborts_the_request(llm_engine):
    async def main():
        engine = AsyncLLMEngine(llm_engine)
        reader = asyncio.ensure_future(collect(engine, "cancelled", greedy(100)))
        while engine.stats.num_running == 0:
            await asyncio.sleep(0.01)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        await wait_all_blocks_free(engine)
        await engine.shutdown()
    run(main())
    assert not llm_engine.has_unfinished_requests()


def test_abort_ends_the_stream_with_request_aborted(llm_engine):
    async def main():
        engine = AsyncLLMEngine(llm_engine)
        stream = await engine.add_request("x", PROMPT, greedy(100))
        await stream.__anext__()
        engine.abort("x")
        with pytest.raises(RequestAbortedError):
            async for _ in stream:
                pass
        await wait_all_blocks_free(engine)
        await engine.shutdown()
    run(main())


def test_queue_limit_refuses_requests_waiting_to_be_scheduled(llm_engine):
    async def main():
        engine = AsyncLLMEngine(llm_engine, max_waiting=1)
        first, second = engine.generate("1", PROMPT, greedy(3)), engine.generate("2", PROMPT, greedy(3))
        # Both are admitted in the same event-loop turn, before the first can have been scheduled.
        results = await asyncio.gather(first.__anext__(), second.__anext__(), return_exceptions=True)
        await first.aclose()
        later = await collect(engine, "3", greedy(2))     # the queue is free again
        await engine.shutdown()
        return results, later, engine
    results, later, engine = run(main())
    assert not isinstance(results[0], Exception)
    assert isinstance(results[1], QueueFullError)
    assert later[-1].finished and engine.num_waiting == 0


def test_shutdown_drains_in_flight_requests_then_refuses_new_ones(llm_engine):
    async def main():
        engine = AsyncLLMEngine(llm_engine)
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


def test_shutdown_without_drain_ends_streams_with_an_error(llm_engine):
    async def main():
        engine = AsyncLLMEngine(llm_engine)
        reader = asyncio.ensure_future(collect(engine, "dropped", greedy(100)))
        while engine.stats.num_running == 0:
            await asyncio.sleep(0.01)
        await engine.shutdown(drain=False)
        with pytest.raises(EngineShutdownError):
            await reader
    run(main())
    assert llm_engine.block_manager.num_free_blocks == llm_engine.block_manager.num_blocks


def test_engine_built_on_the_engine_thread_and_load_errors_raised(tiny_llama):
    args = EngineArgs(model=tiny_llama, skip_tokenizer_init=True, dtype="float32", block_size=8, max_model_len=128)

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
