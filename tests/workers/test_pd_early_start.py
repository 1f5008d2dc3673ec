"""Early start: the decode worker sends PrefillStart while its engine thread reserves the blocks
(which waits for the step in flight), with the prefix-cache hits probed first. The prefill may
then finish before the reservation: its chunks wait, and nothing is written before the blocks
are reserved. A probe that the cache outran starts over; a failed or abandoned reservation
reaches the load that started early, and nothing is stranded."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.block_pool import NoFreeBlocksError
from kvrelay.engine.engine_args import EngineArgs
from kvrelay.engine.handoff import PrefixChangedError
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.worker_base import WorkerOptions
from pd_helpers import (
    assert_all_free,
    hold_engine_thread,
    reference_tokens,
    start_pair,
    stop_pair,
    wait_until,
)
from test_pd_failures import _tokens

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PREFIX = list(range(20, 84))  # 4 full blocks of 16


async def _engine(**kw) -> AsyncEngine:
    engine = AsyncEngine(EngineArgs(**kw))
    await engine.start()
    return engine


async def test_the_load_starts_before_the_reservation_with_the_probed_prefix():
    engine = await _engine(num_kv_blocks=32)
    try:
        await _tokens(engine.generate(PREFIX + [5], PARAMS))  # caches PREFIX's 4 blocks
        seen = []

        async def load(res):
            seen.append((res.done, res.num_blocks, res.num_cached_blocks))
            block_ids = await res.wait()
            seen.append(len(block_ids))
            return 7, None

        prompt = PREFIX + list(range(100, 120))  # 84 tokens: 6 blocks, 4 of them cached
        got = await _tokens(engine.generate_prefilled(prompt, PARAMS, "r", 0, load, early_start=True))
        assert seen == [(False, 6, 4), 6]
        assert got[0] == 7 and len(got) == PARAMS.max_tokens
        await assert_all_free(engine)
    finally:
        await engine.shutdown()


async def test_a_probe_the_cache_outran_starts_over_without_early_start(monkeypatch):
    """The probe counted a block the reservation no longer finds (evicted in between): the early
    load is given up with PrefixChangedError and a second one runs on a finished reservation."""
    engine = await _engine(num_kv_blocks=32)
    try:
        await _tokens(engine.generate(PREFIX + [5], PARAMS))
        probe = engine.engine.probe_cached_blocks
        monkeypatch.setattr(engine.engine, "probe_cached_blocks", lambda ids, salt, lora=None: probe(ids, salt, lora) + 1)
        loads = []

        async def load(res):
            loads.append((res.done, res.num_cached_blocks))
            if not res.done:
                with pytest.raises(PrefixChangedError):
                    await res.wait()
                raise AssertionError("the reservation must fail, not the load")
            return 7, None

        prompt = PREFIX + list(range(100, 120))
        got = await _tokens(engine.generate_prefilled(prompt, PARAMS, "r", 0, load, early_start=True))
        assert loads == [(False, 5), (True, 4)]
        assert got[0] == 7
        await assert_all_free(engine)
    finally:
        await engine.shutdown()


async def test_a_pool_that_cannot_hold_the_prompt_starts_no_prefill():
    """Admission stays with the decode side's memory: a worker whose free blocks cannot hold the
    prompt rejects it before load_kv (the prefill) starts."""
    engine = await _engine(num_kv_blocks=16, max_model_len=256)
    try:
        loads = []

        async def load(res):
            loads.append(res)
            return 7, None

        hog = await engine.call_in_engine_thread(lambda llm: llm.pool.allocate(10))
        with pytest.raises(NoFreeBlocksError):  # 13 blocks, 6 free
            await _tokens(engine.generate_prefilled([5] * 200, PARAMS, "big", 0, load, early_start=True))
        assert loads == []
        await engine.call_in_engine_thread(lambda llm: llm.pool.free(hog))
        await assert_all_free(engine)
    finally:
        await engine.shutdown()


async def test_a_failed_reservation_reaches_the_early_load_and_its_threads():
    """The pool looked large enough when the load started, but the blocks were gone when the
    engine thread reserved: the load and a thread waiting in it get the reservation's error."""
    engine = await _engine(num_kv_blocks=32)
    try:
        release, held = await hold_engine_thread(engine)
        # Queued before the reservation, run after the check that let the load start.
        hog = engine.call_in_engine_thread(lambda llm: llm.pool.allocate(llm.pool.num_free))
        outcome = []

        async def load(res):
            release.set()
            waiter = threading.Thread(target=lambda: outcome.append(_blocking_outcome(res)))
            waiter.start()
            try:
                await res.wait()
            finally:
                await asyncio.to_thread(waiter.join, 10)
            return 7, None

        with pytest.raises(NoFreeBlocksError):
            await _tokens(engine.generate_prefilled([5] * 200, PARAMS, "big", 0, load, early_start=True))
        assert outcome == ["NoFreeBlocksError"]
        await held
        blocks = await hog
        await engine.call_in_engine_thread(lambda llm: llm.pool.free(blocks))
        await assert_all_free(engine)
    finally:
        await engine.shutdown()


async def test_a_request_cancelled_during_its_reservation_wakes_a_waiting_thread():
    """A doorbell thread waiting for the reservation must not wait forever when the request goes."""
    engine = await _engine(num_kv_blocks=32)
    try:
        release, blocker = await hold_engine_thread(engine)  # the reservation now queues behind it
        outcome, waiting = [], threading.Event()

        async def load(res):
            def wait():
                waiting.set()
                outcome.append(_blocking_outcome(res))

            threading.Thread(target=wait, daemon=True).start()
            await asyncio.Event().wait()

        task = asyncio.create_task(_tokens(engine.generate_prefilled(PREFIX, PARAMS, "r", 0, load, early_start=True)))
        assert await asyncio.to_thread(waiting.wait, 10)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await wait_until(lambda: bool(outcome), what="the waiting thread to wake")
        assert outcome == ["RuntimeError"]
        release.set()
        await blocker
        await assert_all_free(engine)
    finally:
        await engine.shutdown()


def _blocking_outcome(res) -> str:
    try:
        res.wait_blocking(30)
    except Exception as e:  # noqa: BLE001 - the test reads which error came
        return type(e).__name__
    return "reserved"


# ---- real workers: the prefill finishes before the decode side has reserved -------------------------


async def prefill_done_before_reservation(pair, prompt: list[int], params, rid: str) -> list[int]:
    """Generate with the decode worker's engine thread held until the prefill worker has
    computed the prompt (and rung, on a doorbell), so every chunk waits for the reservation."""
    release, blocker = await hold_engine_thread(pair.decode.engine)
    task = asyncio.create_task(_tokens(pair.client.generate(prompt, params, request_id=rid,
                                                            prefill_addr=pair.prefill_addr)))
    try:
        await wait_until(lambda: any(lease.compute_done for lease in pair.prefill.leases.by_request(rid)),
                         what="the prefill worker to finish computing")
    finally:
        release.set()
    await blocker
    return await task


def _count(metric, label: str) -> float:
    return metric.labels(label)._value.get()


@pytest.mark.parametrize("plane", ["grpc", "shm_doorbell", "shm_stream"])
async def test_chunks_that_arrive_before_the_reservation_wait_for_it(tmp_path, plane):
    """Same tokens as a single process, with no fallback: the stream's chunks wait in the stream,
    the doorbell's frames in the doorbell thread, until the blocks are reserved."""
    popts = WorkerOptions(max_message_bytes=16 * 1024, stream_min_tokens=50, layer_group_size=1,
                          kv_shm_dir=str(tmp_path))
    dopts = WorkerOptions(max_message_bytes=16 * 1024, kv_shm_dir=str(tmp_path),
                          kv_shm_bytes=0 if plane == "grpc" else 4 << 20, kv_doorbell=plane == "shm_doorbell")
    pair = await start_pair(prefill_options=popts, decode_options=dopts)
    try:
        assert pair.decode.early_start
        rng = random.Random(7)
        for i, n in enumerate((20, 90)):  # after the prefill, and layer-streamed
            prompt = [rng.randrange(3, 512) for _ in range(n)]
            got = await prefill_done_before_reservation(pair, prompt, PARAMS, f"r{i}")
            assert got == await reference_tokens(prompt, PARAMS)
        m = pair.decode.metrics
        assert _count(m.kv_handoffs, "ack") == 2
        assert _count(m.fallbacks, "local") == 0 and _count(m.fallbacks, "retry") == 0
        if plane == "shm_doorbell":
            assert pair.prefill.metrics.doorbells.labels("connected")._value.get() == 2
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)


async def test_early_start_off_reserves_first():
    pair = await start_pair(decode_options=WorkerOptions(kv_early_start=False))
    try:
        assert not pair.decode.early_start
        prompt = list(range(30, 70))
        got = await _tokens(pair.client.generate(prompt, PARAMS, prefill_addr=pair.prefill_addr))
        assert got == await reference_tokens(prompt, PARAMS)
    finally:
        await stop_pair(pair)


@pytest.mark.parametrize("doorbell", [True, False], ids=["doorbell", "stream"])
async def test_an_abort_while_the_hand_off_waits_for_the_reservation_frees_everything(tmp_path, doorbell):
    """The doorbell thread waits for the reservation outside the hand-off's lock, so an abort
    that gives the hand-off up meanwhile neither blocks the event loop nor strands a block; and the
    prefill worker's messages, which nothing has read yet, are drained so that it is seen to end
    the call: the shared-memory region comes back at once, not after the 60 s quarantine."""
    popts = WorkerOptions(kv_shm_dir=str(tmp_path))
    # A doorbell thread waiting inside the lock would hold the loop until the engine thread is let go.
    dopts = WorkerOptions(kv_shm_dir=str(tmp_path), kv_shm_bytes=4 << 20, handoff_timeout_s=120,
                          kv_doorbell=doorbell)
    pair = await start_pair(prefill_options=popts, decode_options=dopts)
    try:
        release, blocker = await hold_engine_thread(pair.decode.engine)
        task = asyncio.create_task(_tokens(pair.client.generate(list(range(30, 90)), PARAMS, request_id="r",
                                                                prefill_addr=pair.prefill_addr)))
        try:
            await wait_until(lambda: any(lease.compute_done for lease in pair.prefill.leases.by_request("r")),
                             what="the prefill worker to ring")
            # The loop must stay free: this call and the abort complete while the engine thread is held.
            assert await asyncio.wait_for(pair.client.abort("r"), 10)
            await wait_until(lambda: pair.decode.active_handoffs() == 0, what="the hand-off to end")
            assert not blocker.done()
        finally:
            release.set()
        await blocker
        got = await task  # aborted: no token, or none beyond what came before the abort
        assert got == []
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
        arena = pair.decode.arena
        await wait_until(lambda: arena.free_bytes == arena.capacity, what="the region to come back")
    finally:
        await stop_pair(pair)


@pytest.mark.parametrize("doorbell", [False, True], ids=["stream", "doorbell"])
async def test_a_pull_given_up_at_any_moment_gets_its_region_back_at_once(tmp_path, doorbell):
    """A pull given up after k turns of the event loop: while PrefillStart is being written, while
    the exchange waits for its reservation with the prefill worker's messages unread, or later.
    The prefill worker is seen to end the call after the abort every time, so the region returns
    to the arena when the pull ends, never into the quarantine. (A pull given up during the
    write once left the header unread, so the call's status never came and the grace ran out.)"""
    from kvrelay.kvtransfer.transport import HandoffRequest, KVDestination

    dopts = WorkerOptions(kv_shm_dir=str(tmp_path), kv_shm_bytes=4 << 20, kv_doorbell=doorbell)
    pair = await start_pair(prefill_options=WorkerOptions(kv_shm_dir=str(tmp_path)), decode_options=dopts)
    transport, arena = pair.decode.transport, pair.decode.arena
    transport.shm_quarantine_s = 3600.0
    try:
        for k in range(12):
            given_up = threading.Event()

            def unreserved(given_up=given_up):  # the doorbell thread's: fails once the pull is given up
                given_up.wait(30)
                raise RuntimeError("the pull was given up")

            def never_written(batch):
                raise AssertionError("nothing is written before the reservation")

            async def never_written_async(batch):
                never_written(batch)

            dest = KVDestination([], never_written_async, write_now=never_written,
                                 reserved=asyncio.Event().wait, reserved_blocking=unreserved)
            request = HandoffRequest(f"k{k}", list(range(30, 90)), PARAMS)
            task = asyncio.create_task(transport.pull(pair.prefill_addr, request, dest))
            for _ in range(k):
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            given_up.set()
            assert task.cancelled()
            assert arena.free_bytes == arena.capacity, f"given up after {k} turns: region not back"
            await wait_until(lambda: not pair.prefill.leases._by_id, what=f"the prefill worker to end k{k}")
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)


async def test_hand_offs_join_an_async_scheduled_batch_with_single_process_tokens():
    """A decode worker with async scheduling (step N+1 launched before step N's tokens are read)
    takes hand-offs while its batch decodes: the first token goes out before the activation, the
    sequence joins between launches, and every request's tokens are a single process's."""
    pair = await start_pair(async_scheduling=True)
    try:
        assert pair.decode.engine.engine.overlap is not None
        rng = random.Random(11)
        long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        seeded = SamplingParams(temperature=0.9, top_k=30, seed=5, max_tokens=12, ignore_eos=True)
        background = [[rng.randrange(3, 512) for _ in range(24)] for _ in range(3)]
        handed = [([rng.randrange(3, 512) for _ in range(n)], params)
                  for n, params in ((17, PARAMS), (70, seeded), (33, PARAMS))]
        streamed: list[list[int]] = [[] for _ in background]

        async def decode(k: int) -> None:
            async for out in pair.client.generate(background[k], long):
                streamed[k] += out.new_token_ids

        running = [asyncio.create_task(decode(k)) for k in range(len(background))]
        await wait_until(lambda: all(streamed), what="the batch to decode")
        got = [await _tokens(pair.client.generate(p, params, prefill_addr=pair.prefill_addr)) for p, params in handed]
        for task in running:  # still decoding: each of 400 tokens takes a step
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        assert got == [await reference_tokens(p, params) for p, params in handed]
        for prompt, tokens in zip(background, streamed, strict=True):
            assert 0 < len(tokens) < long.max_tokens
            assert tokens == (await reference_tokens(prompt, long))[:len(tokens)]
        assert _count(pair.decode.metrics.kv_handoffs, "ack") == 3
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)


@pytest.mark.parametrize("plane", ["grpc", "shm_doorbell"])
async def test_cancels_and_aborts_at_random_moments_strand_nothing(tmp_path, plane):
    """Requests cancelled (the client hangs up) or aborted (PrefillService-style Abort on the decode
    worker) at random moments, before, during and after the reservation, the transfer and the
    first token, while a batch decodes: every request that completes has a single process's
    tokens, and both pools end free with no hand-off open."""
    dopts = WorkerOptions(kv_shm_dir=str(tmp_path), kv_shm_bytes=0 if plane == "grpc" else 4 << 20)
    pair = await start_pair(prefill_options=WorkerOptions(kv_shm_dir=str(tmp_path), stream_min_tokens=40,
                                                          layer_group_size=1), decode_options=dopts)
    rng = random.Random(2026)
    long = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    background = [asyncio.create_task(_tokens(pair.client.generate([rng.randrange(3, 512) for _ in range(20)], long)))
                  for _ in range(2)]
    try:
        async def one(i: int) -> tuple[list[int], list[int]] | None:
            prompt = [rng.randrange(3, 512) for _ in range(rng.choice((9, 30, 75)))]
            rid, fate, delay = f"r{i}", rng.choice(("complete", "cancel", "abort")), rng.uniform(0, 0.02)
            task = asyncio.create_task(_tokens(pair.client.generate(prompt, PARAMS, request_id=rid,
                                                                    prefill_addr=pair.prefill_addr)))
            if fate == "complete":
                return prompt, await task
            await asyncio.sleep(delay)
            if fate == "abort":
                await pair.client.abort(rid)
            else:
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None

        sem = asyncio.Semaphore(4)

        async def limited(i: int):
            async with sem:
                return await one(i)

        done = [r for r in await asyncio.gather(*(limited(i) for i in range(24))) if r is not None]
        assert done  # the fates above include completions
        for prompt, got in done:
            assert got == await reference_tokens(prompt, PARAMS)
    finally:
        for t in background:
            t.cancel()
        await asyncio.gather(*background, return_exceptions=True)
    try:
        # Rarely a prefill worker's handler lasts until its call's deadline (the hand-off timeout, 15 s).
        await wait_until(lambda: pair.decode.active_handoffs() == 0 and not pair.prefill.leases._by_id,
                         timeout_s=40, what="every hand-off to end")
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
        arena = pair.decode.arena
        # Every region back, none quarantined: a clean-up cut short by a second cancel once leaked them,
        # and an exchange stopped while it waited for its reservation left the stream undrained.
        if arena is not None:
            await wait_until(lambda: arena.free_bytes == arena.capacity, what="the arena to be free")
    finally:
        await stop_pair(pair)
