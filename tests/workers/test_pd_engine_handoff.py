"""AsyncEngine.generate_prefilled (the decode side's engine entry point) on its own."""

from __future__ import annotations

import asyncio

import pytest
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.block_pool import NoFreeBlocksError
from kvrelay.engine.engine_args import EngineArgs
from kvrelay.engine.sampling_params import SamplingParams
from pd_helpers import assert_all_free, hold_engine_thread

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT = list(range(20, 90))


class LoadFailed(Exception):
    pass


async def test_failed_attempt_never_leaks_into_a_retry_with_the_same_id():
    """A failed hand-off's cleanup must not reach the stream of the retry that reuses its id
    (it once ended retries after their first token, or with no token at all)."""
    # 128 blocks hold the four busy requests at full length (27 blocks each) beside the attempts:
    # with 64, a slow run filled the pool and reserve() refused an attempt (it never waits).
    engine = AsyncEngine(EngineArgs(num_kv_blocks=128))
    await engine.start()
    try:
        want = [t async for o in engine.generate(PROMPT, PARAMS, "ref") for t in o.new_token_ids]

        async def failing_load(res):
            raise LoadFailed

        # Other requests keep the engine stepping, so outputs of a loop iteration are dispatched a
        # step after the commands of that iteration ran: the window in which the bug showed.
        busy = [engine.generate([7] * 30, SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True), f"b{k}")
                for k in range(4)]
        busy_tasks = [asyncio.create_task(_drain(g)) for g in busy]
        for i in range(30):
            rid = f"r{i}"
            with pytest.raises(LoadFailed):
                async for _ in engine.generate_prefilled(PROMPT, PARAMS, rid, 0, failing_load):
                    pass
            await engine.call_in_engine_thread(lambda llm: None)  # the failed attempt's free has run
            got = [t async for o in engine.generate(PROMPT, PARAMS, rid) for t in o.new_token_ids]
            assert got == want, f"attempt {i}"
        for t in busy_tasks:
            t.cancel()
        await asyncio.gather(*busy_tasks, return_exceptions=True)
        for g in busy:
            await g.aclose()
        await assert_all_free(engine)
    finally:
        await engine.shutdown()


async def test_reserve_rejects_when_the_pool_is_short_and_frees_on_close():
    engine = AsyncEngine(EngineArgs(num_kv_blocks=32))
    await engine.start()
    try:
        async def never_loads(res):
            assert len(res.block_ids) == 32  # the whole pool
            await engine.call_in_engine_thread(lambda llm: None)
            raise LoadFailed

        with pytest.raises(LoadFailed):
            async for _ in engine.generate_prefilled([5] * 500, PARAMS, "big", 0, never_loads):
                pass
        await engine.call_in_engine_thread(lambda llm: None)
        held = engine.generate_prefilled([5] * 500, PARAMS, "held", 0, lambda res: _forever())
        task = asyncio.create_task(anext(held))
        await asyncio.sleep(0.2)
        with pytest.raises(NoFreeBlocksError):
            async for _ in engine.generate_prefilled(PROMPT, PARAMS, "rejected", 0, never_loads):
                pass
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await held.aclose()
        await assert_all_free(engine)
    finally:
        await engine.shutdown()


async def _forever():
    await asyncio.Event().wait()


async def _drain(gen) -> None:
    async for _ in gen:
        pass


async def test_reservation_shares_cached_prefix_blocks_and_gives_them_back():
    """The prompt's cached full blocks lead the reservation (load_kv fills only the rest); a
    reservation that does not fit returns the references it took, and the prefix stays cached."""
    engine = AsyncEngine(EngineArgs(num_kv_blocks=16, max_model_len=256))
    await engine.start()
    try:
        prompt = list(range(20, 84))  # 4 full blocks
        _ = [o async for o in engine.generate(prompt, PARAMS)]
        seen = []

        async def load(res):
            seen.append((len(res.block_ids), res.num_cached_blocks))
            raise LoadFailed

        with pytest.raises(LoadFailed):
            async for _ in engine.generate_prefilled(prompt + [5] * 10, PARAMS, "r1", 0, load):
                pass
        held = engine.generate_prefilled([9] * 40, PARAMS, "held", 0, lambda res: _forever())  # 3 blocks
        task = asyncio.create_task(anext(held))
        await asyncio.sleep(0.2)
        with pytest.raises(NoFreeBlocksError):  # 16 blocks: 4 cached + 12 of the 9 left
            async for _ in engine.generate_prefilled(prompt + [6] * 180, PARAMS, "big", 0, load):
                pass
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await held.aclose()
        with pytest.raises(LoadFailed):
            async for _ in engine.generate_prefilled(prompt + [5] * 10, PARAMS, "r2", 0, load):
                pass
        assert seen == [(5, 4), (5, 4)]
        await engine.call_in_engine_thread(lambda llm: None)
        await assert_all_free(engine)
    finally:
        await engine.shutdown()


async def test_abort_waits_for_a_write_into_the_reservation_from_another_thread():
    """The doorbell writes K/V from its own thread (LLMEngine.write_reserved): an abort that
    arrives meanwhile frees the blocks only after the copy, and no write starts after it."""
    import threading

    engine = AsyncEngine(EngineArgs(num_kv_blocks=16, max_model_len=256))
    await engine.start()
    try:
        reserved = asyncio.get_running_loop().create_future()
        copying, release = threading.Event(), threading.Event()
        events = []

        async def load(res):
            reserved.set_result(res.block_ids)
            await _forever()

        gen = engine.generate_prefilled(list(range(20, 60)), PARAMS, "r", 0, load)
        task = asyncio.create_task(anext(gen))
        block_ids = await reserved

        def slow_copy():
            copying.set()
            release.wait(5)
            events.append("copied")

        writer = threading.Thread(target=lambda: events.append(engine.engine.write_reserved("r", block_ids, slow_copy)))
        writer.start()
        assert copying.wait(5)
        await engine.abort("r")
        await asyncio.sleep(0.3)  # the engine thread is now blocked in abort, waiting for the copy
        assert engine.engine.pool.num_free < engine.engine.pool.num_blocks  # not freed under the copy
        release.set()
        writer.join(5)
        assert events == ["copied", True]
        await assert_all_free(engine)
        assert engine.engine.write_reserved("r", block_ids, lambda: events.append("late")) is False
        assert events == ["copied", True]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await gen.aclose()
    finally:
        await engine.shutdown()


async def test_the_first_token_goes_out_while_the_engine_thread_is_busy():
    """The first output is made on the caller's thread: it does not wait for the step in flight,
    and the tokens after it are those of a single process."""
    engine = AsyncEngine(EngineArgs(num_kv_blocks=64))
    await engine.start()
    try:
        prompt = list(range(20, 68))  # 3 full blocks, which the prefix cache keeps after "ref"
        want = [t async for o in engine.generate(prompt, PARAMS, "ref") for t in o.new_token_ids]
        held = {}

        async def load(res):
            assert res.num_cached_blocks == res.num_blocks == 3  # the K/V is all there: nothing to write
            held["release"], held["done"] = await hold_engine_thread(engine)
            return want[0], None

        gen = engine.generate_prefilled(prompt, PARAMS, "r", 0, load)
        first = await asyncio.wait_for(anext(gen), 20)  # while the engine thread is still held
        assert first.new_token_ids == [want[0]] and not first.finished and first.text
        assert not held["done"].done()
        held["release"].set()
        await held["done"]
        rest = [t async for o in gen for t in o.new_token_ids]
        assert [want[0], *rest] == want
        await assert_all_free(engine)
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("case", ["max_tokens", "eos", "stop_string"])
async def test_a_first_token_that_ends_the_request_finishes_it_and_frees_the_blocks(case):
    engine = AsyncEngine(EngineArgs(num_kv_blocks=64))
    await engine.start()
    try:
        prompt = list(range(20, 68))
        first_token, first_text = 300, engine.engine.tokenizer.decode([300])
        params = {"max_tokens": SamplingParams(temperature=0.0, max_tokens=1),
                  "eos": SamplingParams(temperature=0.0, max_tokens=8),
                  "stop_string": SamplingParams(temperature=0.0, max_tokens=8, stop=[first_text.strip()])}[case]
        if case == "eos":
            first_token = min(engine.engine.eos_ids)

        async def load(res):
            return first_token, None

        outs = [o async for o in engine.generate_prefilled(prompt, params, "r", 0, load)]
        assert len(outs) == 1 and outs[0].new_token_ids == [first_token]
        assert (outs[0].finish_reason, outs[0].stop_reason) == {
            "max_tokens": ("length", None), "eos": ("stop", None), "stop_string": ("stop", first_text.strip())}[case]
        await assert_all_free(engine)
        stats = await engine.call_in_engine_thread(lambda llm: llm.generation_tokens_total)
        assert stats == 1
    finally:
        await engine.shutdown()


async def test_an_abort_between_the_first_token_and_the_activation_ends_the_stream():
    engine = AsyncEngine(EngineArgs(num_kv_blocks=64))
    await engine.start()
    try:
        held = {}

        async def load(res):
            held["release"], held["done"] = await hold_engine_thread(engine)
            await engine.abort("r")  # queued behind the held step, before the activation
            return 300, None

        gen = engine.generate_prefilled(list(range(20, 68)), PARAMS, "r", 0, load)
        first = await anext(gen)
        assert first.new_token_ids == [300] and not first.finished
        held["release"].set()
        assert [o async for o in gen] == []  # the activation found the request gone
        await assert_all_free(engine)
    finally:
        await engine.shutdown()
