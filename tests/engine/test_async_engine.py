"""The async API the workers and the gateway use: streams, cancel, abort, stats, errors."""

from __future__ import annotations

import asyncio

import pytest
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.engine_args import EngineArgs
from kvrelay.engine.errors import InvalidRequestError
from kvrelay.engine.sampling_params import SamplingParams


@pytest.fixture
async def engine():
    eng = AsyncEngine(EngineArgs())
    await eng.start()
    yield eng
    await eng.shutdown()


async def _wait_idle(engine: AsyncEngine):
    for _ in range(200):
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_blocks_free == s.kv_blocks_total:
            return s
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine not idle: {engine.stats()}")


async def test_concurrent_streams_match_offline_generation(engine):
    async def run(i):
        text, ids = "", []
        async for out in engine.generate(
            "Once upon a time", SamplingParams(max_tokens=20, temperature=0.8, seed=i), f"r{i}"
        ):
            text += out.text
            ids += out.new_token_ids
            last = out
        assert last.finish_reason == "length" and last.num_generated_tokens == 20
        return ids

    results = await asyncio.gather(*(run(i) for i in range(6)))
    from kvrelay.engine.llm_engine import LLMEngine

    offline = LLMEngine(EngineArgs())
    offline.add_request("Once upon a time", SamplingParams(max_tokens=20, temperature=0.8, seed=3), "x")
    ids = []
    while offline.has_work():
        for o in offline.step():
            ids += o.new_token_ids
    assert results[3] == ids
    stats = await _wait_idle(engine)
    assert stats.generation_tokens_total == 120


async def test_closing_the_iterator_aborts_and_frees_blocks(engine):
    gen = engine.generate("Once upon a time", SamplingParams(max_tokens=400, temperature=0), "c")
    async for out in gen:
        if out.num_generated_tokens >= 3:
            break
    assert engine.stats().num_running == 1
    await gen.aclose()
    await _wait_idle(engine)


async def test_abort_by_id_ends_the_stream_with_abort(engine):
    reasons = []

    async def consume():
        async for out in engine.generate("Lily", SamplingParams(max_tokens=400, temperature=0), "ab"):
            if out.num_generated_tokens == 2:
                await engine.abort("ab")
            reasons.append(out.finish_reason)

    await asyncio.wait_for(consume(), 10)
    assert reasons[-1] == "abort"
    await _wait_idle(engine)


async def test_task_cancellation_frees_blocks(engine):
    async def consume():
        async for _ in engine.generate("Lily", SamplingParams(max_tokens=400, temperature=0), "t"):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await _wait_idle(engine)


async def test_bad_input_raises_before_scheduling(engine):
    with pytest.raises(InvalidRequestError) as e:
        async for _ in engine.generate("Lily", SamplingParams(temperature=-1), "bad"):
            pass
    assert e.value.field == "temperature"
    assert engine.stats().num_waiting == 0


async def test_n_samples_stream_each_index(engine):
    seen = set()
    async for out in engine.generate("Lily", SamplingParams(n=3, max_tokens=5, temperature=1.0, seed=1), "n"):
        if out.finished:
            seen.add(out.index)
    assert seen == {0, 1, 2}


async def test_call_in_engine_thread_returns_result_and_raises(engine):
    assert await engine.call_in_engine_thread(lambda e: e.pool.num_blocks) == engine.stats().kv_blocks_total
    with pytest.raises(KeyError):
        await engine.call_in_engine_thread(lambda e: e.requests["nope"])


async def test_reusing_an_id_right_after_closing_is_not_hit_by_the_stale_abort(engine):
    for _ in range(5):
        gen = engine.generate("Lily", SamplingParams(max_tokens=400, temperature=0), "same")
        async for _ in gen:
            break
        await gen.aclose()
        outs = [o async for o in engine.generate("Lily", SamplingParams(max_tokens=6, temperature=0), "same")]
        assert outs[-1].finish_reason == "length" and outs[-1].num_generated_tokens == 6
    await _wait_idle(engine)
