"""Failure scenarios on real worker processes (SIGKILL) and in-process workers: every one ends
with a correct answer or a clear error, never a hang, and with zero stranded KV blocks."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.client import DecodeClient, watch_load
from kvrelay.kvtransfer.errors import LayoutMismatchError, NoCapacityError, WorkerUnavailableError
from kvrelay.kvtransfer.worker_base import WorkerOptions, run_until_stopped
from pd_helpers import (
    assert_all_free,
    assert_worker_free,
    free_port,
    load_report,
    metric_value,
    reference_tokens,
    scrape,
    start_pair,
    stop_pair,
    wait_until,
)

_rng = random.Random(3)
PROMPT = [_rng.randrange(3, 512) for _ in range(300)]  # one generator: varied tokens
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=99, max_tokens=16, ignore_eos=True)
# Many small chunks sent slowly: a transfer lasts ~10 s, long enough to kill something mid-way.
SLOW_PREFILL = ("--max-message-bytes", "16KiB", "--stream-min-tokens", "100000", "--debug-chunk-delay", "0.25")


async def _handoff_started(prefill_addr: str) -> None:
    async def started():
        return (await load_report(prefill_addr)).active_handoffs >= 1

    await wait_until(started, what="the hand-off to start")
    await asyncio.sleep(1.0)  # a few chunks are through: mid-transfer


async def _tokens(stream) -> list[int]:
    return [t async for o in stream for t in o.new_token_ids]


@pytest.mark.parametrize("recovery", ["local", "retry"])
async def test_prefill_killed_mid_transfer(spawn, recovery):
    """The decode worker notices at once, frees its reservation, and retries on the next prefill
    worker or prefills locally: the client gets the single-process answer."""
    victim = spawn("prefill", *SLOW_PREFILL)
    backup = spawn("prefill") if recovery == "retry" else None
    mport = free_port()
    decode = spawn("decode", "--max-message-bytes", "16KiB", "--metrics-port", str(mport))
    want = await reference_tokens(PROMPT, SEEDED)
    addrs = [victim.addr] + ([backup.addr] if backup else [])
    async with DecodeClient(decode.addr) as client:
        task = asyncio.create_task(_tokens(client.generate(PROMPT, SEEDED, "kill-p", prefill_addr=addrs)))
        await _handoff_started(victim.addr)
        killed_at = time.monotonic()
        victim.kill()
        got = await asyncio.wait_for(task, 30)
        recovered_s = time.monotonic() - killed_at
    assert got == want
    page = scrape(mport)
    assert metric_value(page, "kvrelay:kv_transfer_fallbacks_total", f'kind="{recovery}"') == 1
    assert metric_value(page, "kvrelay:kv_transfer_failures_total", 'reason="PrefillFailedError"') == 1
    print(f"recovered {recovery} {recovered_s:.2f} s after the kill")
    await assert_worker_free(decode.addr)
    if backup:
        await assert_worker_free(backup.addr)


async def test_prefill_killed_without_fallback_is_a_clear_error(spawn):
    victim = spawn("prefill", *SLOW_PREFILL)
    decode = spawn("decode", "--max-message-bytes", "16KiB", "--no-local-prefill")
    async with DecodeClient(decode.addr) as client:
        task = asyncio.create_task(_tokens(client.generate(PROMPT, GREEDY, "kill-p2", prefill_addr=victim.addr)))
        await _handoff_started(victim.addr)
        victim.kill()
        with pytest.raises(WorkerUnavailableError, match="no prefill worker could serve"):
            await asyncio.wait_for(task, 30)
    await assert_worker_free(decode.addr)


async def test_decode_killed_mid_transfer_frees_prefill_blocks(spawn):
    mport = free_port()
    prefill = spawn("prefill", *SLOW_PREFILL, "--metrics-port", str(mport))
    decode = spawn("decode", "--max-message-bytes", "16KiB")
    client = DecodeClient(decode.addr)
    task = asyncio.create_task(_tokens(client.generate(PROMPT, GREEDY, "kill-d", prefill_addr=prefill.addr)))

    async def watch_until_dead():
        async for _ in watch_load(decode.addr, interval_s=0.1):
            pass

    watcher = asyncio.create_task(watch_until_dead())
    try:
        await _handoff_started(prefill.addr)
        assert not (await load_report(prefill.addr)).all_blocks_free  # blocks held for the transfer
        decode.kill()
        with pytest.raises(WorkerUnavailableError, match="load stream"):  # how the gateway learns of a death
            await asyncio.wait_for(watcher, 10)
        report = await assert_worker_free(prefill.addr)
        assert report.active_handoffs == 0
        assert metric_value(scrape(mport), "kvrelay:kv_handoffs_total", 'outcome="stream_broken"') == 1
        with pytest.raises(WorkerUnavailableError):
            await asyncio.wait_for(task, 10)
    finally:
        task.cancel()
        await client.close()


async def test_client_cancel_mid_transfer_aborts_both_sides(spawn):
    pport, dport = free_port(), free_port()
    prefill = spawn("prefill", *SLOW_PREFILL, "--metrics-port", str(pport))
    decode = spawn("decode", "--max-message-bytes", "16KiB", "--metrics-port", str(dport))
    async with DecodeClient(decode.addr) as client:
        stream = client.generate(PROMPT, GREEDY, "cancel-1", prefill_addr=prefill.addr)
        task = asyncio.create_task(anext(stream))
        await _handoff_started(prefill.addr)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await stream.aclose()  # cancels the stream and sends an explicit Abort
        await assert_worker_free(prefill.addr, timeout_s=5)
        await assert_worker_free(decode.addr, timeout_s=5)
    assert metric_value(scrape(dport), "kvrelay:kv_transfer_aborts_total", 'reason="client"') == 1
    # The decode worker told the prefill worker explicitly (abort message), not just by hanging up.
    assert metric_value(scrape(pport), "kvrelay:kv_transfer_aborts_total", 'reason="decode"') == 1


async def test_client_cancel_during_decode_frees_blocks():
    pair = await start_pair()
    try:
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        stream = pair.client.generate(PROMPT[:50], params, "cancel-2", prefill_addr=pair.prefill_addr)
        n = 0
        async for out in stream:
            n += len(out.new_token_ids)
            if n >= 3:
                break
        await stream.aclose()
        await assert_all_free(pair.prefill.engine, pair.decode.engine, timeout_s=5)
    finally:
        await stop_pair(pair)


async def test_explicit_abort_ends_with_finish_reason_abort():
    pair = await start_pair(prefill_options=WorkerOptions(debug_chunk_delay_s=0.2, max_message_bytes=16384,
                                                          stream_min_tokens=10**9))
    try:
        # During the transfer.
        stream = pair.client.generate(PROMPT, GREEDY, "abort-1", prefill_addr=pair.prefill_addr)
        first = asyncio.create_task(anext(stream))
        await wait_until(lambda: _true_if(pair.decode.active_handoffs() == 1), what="hand-off")
        assert await pair.client.abort("abort-1")
        out = await asyncio.wait_for(first, 10)
        assert out.finish_reason == "abort" and out.new_token_ids == []
        await stream.aclose()
        # During generation (local prefill: no prefill worker given).
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        outs = []
        async for out in pair.client.generate(PROMPT[:20], params, "abort-2"):
            outs.append(out)
            if len(outs) == 2:
                assert await pair.client.abort("abort-2")
        assert outs[-1].finish_reason == "abort"
        assert sum(len(o.new_token_ids) for o in outs) < 400
        assert not await pair.client.abort("abort-2")  # finished: unknown now
        await assert_all_free(pair.prefill.engine, pair.decode.engine, timeout_s=5)
    finally:
        await stop_pair(pair)


async def _true_if(value: bool) -> bool:
    return value


@pytest.mark.parametrize("mismatch", ["model", "dtype"])
async def test_layout_mismatch_is_rejected_before_any_block_is_written(mismatch, tiny_llama):
    from kvrelay.decode.worker import DecodeWorker
    from kvrelay.engine.async_engine import AsyncEngine
    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.prefill.worker import PrefillWorker

    other = EngineArgs(model=str(tiny_llama), num_kv_blocks=64) if mismatch == "model" else \
        EngineArgs(dtype="bfloat16", num_kv_blocks=64)
    p = PrefillWorker(AsyncEngine(other))
    d = DecodeWorker(AsyncEngine(EngineArgs(num_kv_blocks=64)))
    pp, dp = await p.start(), await d.start()
    try:
        async with DecodeClient(f"127.0.0.1:{dp}") as client:
            with pytest.raises(LayoutMismatchError, match="KV layout mismatch") as err:
                await _tokens(client.generate(PROMPT[:40], GREEDY, prefill_addr=f"127.0.0.1:{pp}"))
        assert ("model_id" if mismatch == "model" else "dtype") in str(err.value)
        assert p.engine.stats().prompt_tokens_total == 0  # the prefill worker never computed it
        assert d.metrics.kv_bytes._value.get() == 0  # nothing was written on the decode side
        await assert_all_free(p.engine, d.engine)
    finally:
        await p.stop(0)
        await d.stop(0)


async def test_corrupted_chunk_is_detected_never_used(monkeypatch):
    """A chunk whose bytes changed in transit fails its checksum; the decode worker drops the
    attempt (freeing its blocks) and prefills locally; with local prefill off it is an error."""
    import kvrelay.prefill.sender as prefill_sender
    from kvrelay.kvtransfer.chunk_wire import encode_chunk_message

    def corrupting_encode(header, t):
        wire = encode_chunk_message(header, t)
        if header.block_start == 0:  # flip one bit of the payload (the message's last bytes)
            wire = wire[:-1] + bytes([wire[-1] ^ 1])
        return wire

    monkeypatch.setattr(prefill_sender, "encode_chunk_message", corrupting_encode)
    pair = await start_pair()
    try:
        want = await reference_tokens(PROMPT[:100], SEEDED)
        got = await _tokens(pair.client.generate(PROMPT[:100], SEEDED, prefill_addr=pair.prefill_addr))
        assert got == want
        assert pair.decode.metrics.failures.labels("ChunkError")._value.get() == 1
        assert pair.decode.metrics.fallbacks.labels("local")._value.get() == 1
        with pytest.raises(WorkerUnavailableError, match="checksum mismatch"):  # a prompt not cached on decode
            await _tokens(pair.client.generate(list(range(200, 300)), SEEDED, prefill_addr=pair.prefill_addr,
                                               allow_local_prefill=False))
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)


async def test_decode_without_room_rejects_instead_of_waiting():
    pair = await start_pair(num_kv_blocks=32, prefill_options=WorkerOptions(
        debug_chunk_delay_s=0.2, max_message_bytes=16384, stream_min_tokens=10**9))
    try:
        holder = pair.client.generate(PROMPT, GREEDY, "holder", prefill_addr=pair.prefill_addr)
        first = asyncio.create_task(anext(holder))
        await wait_until(lambda: _true_if(pair.decode.active_handoffs() == 1), what="hand-off")
        with pytest.raises(NoCapacityError, match="another decode worker"):
            await _tokens(pair.client.generate(PROMPT, GREEDY, "rejected", prefill_addr=pair.prefill_addr))
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await holder.aclose()
        await assert_all_free(pair.prefill.engine, pair.decode.engine, timeout_s=5)
    finally:
        await stop_pair(pair)


async def test_lease_expires_when_decode_never_acknowledges():
    """A decode side that reads everything but never acks (nor hangs up) loses the blocks."""
    from kvrelay.kvtransfer.convert import params_to_proto
    from kvrelay.v1 import kv_pb2, prefill_pb2_grpc

    pair = await start_pair(prefill_options=WorkerOptions(lease_seconds=0.5))
    try:
        async with grpc.aio.insecure_channel(pair.prefill_addr) as ch:
            call = prefill_pb2_grpc.PrefillServiceStub(ch).Prefill()
            await call.write(kv_pb2.PrefillClientMessage(start=kv_pb2.PrefillStart(
                request_id="no-ack", prompt_token_ids=PROMPT[:64], params=params_to_proto(GREEDY),
                expected_layout=pair.prefill.layout.to_proto())))
            kinds = []
            while True:
                msg = await call.read()
                kinds.append(msg.WhichOneof("kind"))
                if kinds[-1] in ("done", "aborted"):
                    break
            assert kinds[0] == "header" and "chunk" in kinds and kinds[-1] == "done"
            assert pair.prefill.active_handoffs() == 1  # held, waiting for the ack
            msg = await asyncio.wait_for(call.read(), 10)  # the prefill side gives up, explicitly
            assert msg.WhichOneof("kind") == "aborted" and "lease expired" in msg.aborted.reason
            call.cancel()
        assert pair.prefill.metrics.lease_expiries._value.get() == 1
        await assert_all_free(pair.prefill.engine)
    finally:
        await stop_pair(pair)


async def test_prefill_refuses_more_cached_blocks_than_the_prompt_has():
    """num_cached_blocks past the prompt's full blocks is the decode side's bug: INVALID_ARGUMENT
    naming the field, before anything is computed or held."""
    from kvrelay.kvtransfer.convert import params_to_proto
    from kvrelay.v1 import kv_pb2, prefill_pb2_grpc

    pair = await start_pair()
    try:
        async with grpc.aio.insecure_channel(pair.prefill_addr) as ch:
            call = prefill_pb2_grpc.PrefillServiceStub(ch).Prefill()
            await call.write(kv_pb2.PrefillClientMessage(start=kv_pb2.PrefillStart(
                request_id="too-many", prompt_token_ids=PROMPT[:40], params=params_to_proto(GREEDY),
                expected_layout=pair.prefill.layout.to_proto(), num_cached_blocks=3)))  # 40 tokens: 2 full
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "num_cached_blocks 3" in e.value.details()
        assert pair.prefill.active_handoffs() == 0
        await assert_all_free(pair.prefill.engine)
    finally:
        await stop_pair(pair)


async def test_unreachable_workers_fail_fast_or_fall_back():
    pair = await start_pair()
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    try:
        want = await reference_tokens(PROMPT[:60], GREEDY)
        got = await asyncio.wait_for(_tokens(pair.client.generate(PROMPT[:60], GREEDY, prefill_addr=dead)), 20)
        assert got == want
        assert pair.decode.metrics.fallbacks.labels("local")._value.get() == 1
        async with DecodeClient(dead) as nobody:
            with pytest.raises(WorkerUnavailableError, match="unreachable"):
                await asyncio.wait_for(_tokens(nobody.generate(PROMPT[:60], GREEDY)), 20)
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_worker_whose_engine_dies_leaves_instead_of_failing_every_request(role):
    """The step loop crashes: the worker stops serving and its runner returns exit code 1 (the
    pod restarts), its load stream breaks (gateways drop it at once), and nothing is stranded."""
    pair = await start_pair()
    worker = getattr(pair, role)
    stop = asyncio.Event()
    runner = asyncio.create_task(run_until_stopped(worker, stop))
    try:
        want = await reference_tokens(PROMPT[:60], GREEDY)
        loads = watch_load(pair.prefill_addr if role == "prefill" else pair.decode_addr, interval_s=0.05)
        await anext(loads)

        def crash():
            raise RuntimeError("injected step failure")

        worker.engine.engine.step = crash
        stream = pair.client.generate(PROMPT[:60], GREEDY, prefill_addr=pair.prefill_addr)
        if role == "prefill":  # the decode worker falls back to a local prefill
            assert await asyncio.wait_for(_tokens(stream), 20) == want
        else:
            with pytest.raises(WorkerUnavailableError, match="engine stopped"):
                await asyncio.wait_for(_tokens(stream), 20)
        assert await asyncio.wait_for(runner, 10) == 1
        assert not stop.is_set()
        with pytest.raises(WorkerUnavailableError):
            async for _ in loads:
                pass
        async with DecodeClient(pair.decode_addr if role == "decode" else pair.prefill_addr) as gone:
            with pytest.raises(WorkerUnavailableError):
                await asyncio.wait_for(_tokens(gone.generate(PROMPT[:60], GREEDY)), 20)
        survivor = pair.decode if role == "prefill" else pair.prefill
        await assert_all_free(survivor.engine)
    finally:
        stop.set()
        await asyncio.gather(runner, return_exceptions=True)
        await stop_pair(pair)


def test_workers_exit_cleanly_on_sigterm(spawn):
    for role in ("prefill", "decode"):
        w = spawn(role)
        w.stop()
        assert w.proc.returncode == 0, "".join(w.lines)


async def test_a_pull_cleanup_runs_to_its_end_through_a_second_cancel():
    """The pull's clean-up (abort towards the prefill worker, free or quarantine the region) runs
    in full even when the task is cancelled again during it: a client that hangs up while its
    abort is on the way once cut it short and leaked the shared-memory region."""
    from kvrelay.kvtransfer.prefill_call import to_completion

    steps = []

    async def cleanup():
        steps.append("start")
        await asyncio.sleep(0.05)
        steps.append("middle")
        await asyncio.sleep(0.05)
        steps.append("end")

    async def pull():
        try:
            await asyncio.sleep(30)
        finally:
            await to_completion(cleanup())

    task = asyncio.create_task(pull())
    await asyncio.sleep(0.01)
    task.cancel()
    while not steps:
        await asyncio.sleep(0.001)
    task.cancel()  # lands during the clean-up
    with pytest.raises(asyncio.CancelledError):
        await task
    assert steps == ["start", "middle", "end"]
