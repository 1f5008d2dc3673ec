"""The Mooncake data plane (kvrelay.kvtransfer.mooncake) with real gRPC workers and the real
transfer engine over its TCP protocol on loopback: the same tokens as a single process, the
inline fallback when the plane cannot open on either side, corrupt bytes caught, aborts and a
killed prefill worker leaving both pools and the region arena free."""

from __future__ import annotations

import asyncio
import ctypes
import random

import numpy as np
import pytest
import torch
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.engine_args import EngineArgs
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.chunk_wire import checksum
from kvrelay.kvtransfer.client import DecodeClient, PrefillClient
from kvrelay.kvtransfer.errors import WorkerUnavailableError
from kvrelay.kvtransfer.mooncake import (
    MooncakeRegions,
    MooncakeWriter,
    PlaneUnavailable,
    RemoteTarget,
    default_host,
)
from kvrelay.kvtransfer.shm import DATA_START, ShmArena
from kvrelay.kvtransfer.worker_base import WorkerOptions
from kvrelay.v1 import kv_pb2
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
from test_pd_failures import PROMPT, SLOW_PREFILL, _handoff_started, _tokens

pytest.importorskip("mooncake.engine", reason="mooncake-transfer-engine-non-cuda and libibverbs1 (scripts/ci.d)")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=5, max_tokens=12, ignore_eos=True, logprobs=2)
REGION_BYTES = 4 << 20


async def _mooncake_pair(tmp_path, streaming: bool = False, delay_s: float = 0.0):
    popts = WorkerOptions(max_message_bytes=16 * 1024, stream_min_tokens=0 if streaming else 10**9,
                          layer_group_size=1, debug_chunk_delay_s=delay_s, kv_mooncake_host="127.0.0.1")
    dopts = WorkerOptions(max_message_bytes=16 * 1024, kv_transport="mooncake", kv_remote_bytes=REGION_BYTES,
                          kv_shm_dir=str(tmp_path), kv_mooncake_host="127.0.0.1")
    return await start_pair(prefill_options=popts, decode_options=dopts)


def _handoffs(pair) -> float:
    return pair.prefill.metrics.plane_handoffs.labels("mooncake")._value.get()


def _fallbacks(worker, reason: str) -> float:
    return worker.metrics.plane_fallbacks.labels("mooncake", reason)._value.get()


def _arena_free(pair) -> bool:
    arena = pair.decode.transport.arena
    return arena.free_bytes == arena.capacity


@pytest.mark.parametrize("streaming", [True, False], ids=["layer_streamed", "after_prefill"])
async def test_mooncake_handoff_equals_single_process(tmp_path, streaming):
    pair = await _mooncake_pair(tmp_path, streaming=streaming)
    ref = AsyncEngine(EngineArgs(num_kv_blocks=96))
    await ref.start()
    try:
        assert pair.decode.transport.remote is not None  # the plane opened
        rng = random.Random(3)
        prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 300)]
        prompts.append(prompts[-1][:200] + [9, 9, 9])  # a prefix-cache hit on the prefill side
        runs = 0
        for prompt in prompts:
            for params in (GREEDY, SEEDED):
                got = [o async for o in pair.client.generate(prompt, params, prefill_addr=pair.prefill_addr)]
                want = [o async for o in ref.generate(prompt, params)]
                assert [o.new_token_ids for o in got] == [o.new_token_ids for o in want]
                assert [(lp.token_id, lp.logprob, lp.top) for o in got for lp in o.logprobs or []] == \
                       [(lp.token_id, lp.logprob, lp.top) for o in want for lp in o.logprobs or []]
                runs += 1
        # Every hand-off that had blocks to send went over the plane: no inline fallback.
        assert _handoffs(pair) >= runs - 2 and _fallbacks(pair.prefill, "unavailable") == 0
        moved = pair.decode.metrics.kv_bytes._value.get()
        assert moved > 16 * 1024  # many chunks' worth
        assert pair.decode.metrics.kv_plane_bytes.labels("mooncake")._value.get() == moved
        assert pair.decode.metrics.fallbacks.labels("local")._value.get() == 0
        assert _arena_free(pair)
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)
        await ref.shutdown()


@pytest.mark.parametrize("side", ["decode", "prefill"])
async def test_inline_fallback_when_the_plane_cannot_open(tmp_path, monkeypatch, side):
    """No transfer engine on the decode worker (it offers nothing) or on the prefill worker (it
    answers inline): the K/V goes on the gRPC stream, counted, and the answer is the same."""
    from kvrelay.kvtransfer import mooncake

    def unavailable(host, protocol, device=""):
        raise PlaneUnavailable("no transfer engine in this test")

    if side == "decode":
        monkeypatch.setattr(mooncake, "open_engine", unavailable)
    pair = await _mooncake_pair(tmp_path)
    if side == "prefill":
        monkeypatch.setattr(mooncake, "open_engine", unavailable)
    try:
        want = await reference_tokens(PROMPT, SEEDED)
        for _ in range(2):  # the prefill worker does not retry a failed engine per hand-off
            assert await _tokens(pair.client.generate(PROMPT, SEEDED, prefill_addr=pair.prefill_addr)) == want
        moved = pair.decode.metrics.kv_bytes._value.get()
        assert moved > 0 and pair.decode.metrics.kv_plane_bytes.labels("grpc")._value.get() == moved
        assert pair.decode.metrics.fallbacks.labels("local")._value.get() == 0
        assert _handoffs(pair) == 0
        if side == "decode":
            assert pair.decode.transport.remote is None and _fallbacks(pair.decode, "unavailable") == 1
        else:
            assert _fallbacks(pair.prefill, "unavailable") == 2 and _arena_free(pair)
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)


async def test_corrupted_remote_chunk_is_detected_never_used(tmp_path, monkeypatch):
    """A bit flipped in the region after the prefill worker hashed and wrote the bytes (on the
    wire, say) fails the decode worker's checksum: the attempt is dropped and the request
    prefilled locally."""
    real = RemoteTarget.place

    def corrupting(self, header, data):
        msg = real(self, header, data)
        ctypes.c_uint8.from_address(self.offer.address + msg.chunk.shm_offset).value ^= 1
        return msg

    monkeypatch.setattr(RemoteTarget, "place", corrupting)
    pair = await _mooncake_pair(tmp_path)
    try:
        want = await reference_tokens(PROMPT[:100], SEEDED)
        assert await _tokens(pair.client.generate(PROMPT[:100], SEEDED, prefill_addr=pair.prefill_addr)) == want
        assert pair.decode.metrics.failures.labels("ChunkError")._value.get() == 1
        assert pair.decode.metrics.fallbacks.labels("local")._value.get() == 1
        assert _arena_free(pair)
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)


@pytest.mark.parametrize("payload", ["block_views", "gathered_tensor"])
def test_remote_target_writes_chunks_back_to_back_into_the_region(tmp_path, payload):
    """Block views of a CPU cache go straight from where they lie (TCP); a gathered tensor (a GPU
    cache's chunk) goes through the registered staging buffer, as RDMA needs. Both land exactly,
    with the XXH3 of the bytes, one chunk after the other."""
    arena = ShmArena(REGION_BYTES, tmp_path)
    regions = MooncakeRegions(arena, "127.0.0.1")
    try:
        region = arena.allocate(64 * 1024)
        writer = MooncakeWriter("127.0.0.1")
        target = writer.remote(regions.offer(region), 64 * 1024)
        rng = np.random.default_rng(0)
        cache = rng.integers(0, 256, size=(3, 2, 8, 1024), dtype=np.uint8)
        chunks = [[cache[0, 0, 2:5], cache[0, 1, 2:5]], [cache[2, 0, 7:8], cache[2, 1, 7:8]]]
        at = 0
        for pieces in chunks:
            want = np.concatenate([p.reshape(-1) for p in pieces])
            data = pieces if payload == "block_views" else torch.from_numpy(want.copy())
            msg = target.place(kv_pb2.KVChunk(), data)
            assert (msg.chunk.shm_offset, msg.chunk.shm_size) == (at, want.nbytes)
            assert msg.chunk.xxh3_64 == checksum(want)
            got = arena.view[region.offset + at:region.offset + at + want.nbytes]
            assert np.array_equal(got, want)
            at += want.nbytes
        with pytest.raises(ValueError, match="does not fit"):
            target.place(kv_pb2.KVChunk(), torch.zeros(64 * 1024, dtype=torch.uint8))
        with pytest.raises(PlaneUnavailable, match="holds"):
            writer.remote(regions.offer(region), 10**9)
    finally:
        regions.close()
    assert not arena.path.exists()


async def test_client_abort_mid_mooncake_transfer_frees_both_sides(tmp_path):
    pair = await _mooncake_pair(tmp_path, delay_s=0.1)
    try:
        task = asyncio.create_task(_tokens(pair.client.generate(PROMPT, SEEDED, "abort-mc",
                                                                prefill_addr=pair.prefill_addr)))

        async def transferring() -> bool:
            return _handoffs(pair) == 1

        async def released() -> bool:
            return pair.prefill.active_handoffs() == 0 and _arena_free(pair)

        await wait_until(transferring, what="the hand-off to start")
        await asyncio.sleep(0.5)  # a few chunks are through
        assert await pair.client.abort("abort-mc")
        await asyncio.wait_for(task, 30)
        await wait_until(released, what="the prefill side and the region to be released")
        assert pair.prefill.metrics.kv_handoffs.labels("decode_abort")._value.get() == 1
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
        # The plane serves the next request as before.
        want = await reference_tokens(PROMPT[:40], GREEDY)
        assert await _tokens(pair.client.generate(PROMPT[:40], GREEDY, prefill_addr=pair.prefill_addr)) == want
        assert _handoffs(pair) == 2
    finally:
        await stop_pair(pair)


async def test_prefill_side_abort_mid_mooncake_transfer_falls_back_and_frees_the_region(tmp_path):
    """An abort on the prefill worker (PrefillService.Abort) mid-transfer: it stops writing, tells
    the decode worker and ends the call, so the region returns at once (no quarantine) and the
    decode worker prefills locally."""
    pair = await _mooncake_pair(tmp_path, delay_s=0.1)
    pair.decode.transport.shm_quarantine_s = 600.0  # a quarantined region would fail the check below
    try:
        want = await reference_tokens(PROMPT, SEEDED)
        task = asyncio.create_task(_tokens(pair.client.generate(PROMPT, SEEDED, "pabort-mc",
                                                                prefill_addr=pair.prefill_addr)))

        async def transferring() -> bool:
            return pair.decode.metrics.kv_bytes._value.get() == 0 and _handoffs(pair) == 1

        await wait_until(transferring, what="the hand-off to start")
        await asyncio.sleep(0.5)
        async with PrefillClient(pair.prefill_addr) as prefill:
            assert await prefill.abort("pabort-mc")
        assert await asyncio.wait_for(task, 30) == want  # prefilled locally
        assert pair.decode.metrics.fallbacks.labels("local")._value.get() == 1
        assert pair.prefill.metrics.kv_handoffs.labels("client_abort")._value.get() == 1
        assert _arena_free(pair)
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)


async def test_prefill_killed_mid_mooncake_transfer_frees_blocks_and_region(spawn, tmp_path):
    victim = spawn("prefill", *SLOW_PREFILL)
    mport = free_port()
    decode = spawn("decode", "--max-message-bytes", "16KiB", "--metrics-port", str(mport), "--kv-transport",
                   "mooncake", "--kv-remote-bytes", "4MiB", "--kv-shm-dir", str(tmp_path))
    want = await reference_tokens(PROMPT, SEEDED)
    async with DecodeClient(decode.addr) as client:
        task = asyncio.create_task(_tokens(client.generate(PROMPT, SEEDED, "kill-mc", prefill_addr=victim.addr)))
        await _handoff_started(victim.addr)
        free_during = metric_value(scrape(mport), "kvrelay:kv_shm_free_bytes")
        victim.kill()
        assert await asyncio.wait_for(task, 30) == want  # prefilled locally
    page = scrape(mport)
    assert free_during < metric_value(page, "kvrelay:kv_shm_free_bytes") == REGION_BYTES - DATA_START
    assert metric_value(page, "kvrelay:kv_transfer_fallbacks_total", 'kind="local"') == 1
    await assert_worker_free(decode.addr)


async def test_decode_killed_mid_mooncake_transfer_frees_prefill_blocks(spawn, tmp_path):
    """The prefill worker's next write into the dead decode worker's region fails, or its stream
    breaks first: either way it frees its held blocks at once."""
    mport = free_port()
    prefill = spawn("prefill", *SLOW_PREFILL, "--metrics-port", str(mport))
    decode = spawn("decode", "--max-message-bytes", "16KiB", "--kv-transport", "mooncake", "--kv-remote-bytes",
                   "4MiB", "--kv-shm-dir", str(tmp_path))
    client = DecodeClient(decode.addr)
    task = asyncio.create_task(_tokens(client.generate(PROMPT, SEEDED, "kill-d-mc", prefill_addr=prefill.addr)))
    try:
        await _handoff_started(prefill.addr)
        page = scrape(mport)
        assert metric_value(page, "kvrelay:kv_plane_handoffs_total", 'plane="mooncake"') == 1
        assert not (await load_report(prefill.addr)).all_blocks_free  # blocks held for the transfer
        decode.kill()
        report = await assert_worker_free(prefill.addr)
        assert report.active_handoffs == 0
        page = scrape(mport)
        ended = sum(metric_value(page, "kvrelay:kv_handoffs_total", f'outcome="{why}"')
                    for why in ("stream_broken", "remote_write_failed"))
        assert ended == 1
        with pytest.raises(WorkerUnavailableError):
            await asyncio.wait_for(task, 10)
    finally:
        task.cancel()
        await client.close()


def test_builtin_planes_by_name_and_their_start_up_fallbacks(tmp_path):
    from kvrelay.kvtransfer.layout import KVLayout
    from kvrelay.kvtransfer.metrics import WorkerMetrics
    from kvrelay.kvtransfer.planes import builtin_transport

    layout = KVLayout("m", "r", "float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
    metrics = WorkerMetrics()
    tiny = WorkerOptions(kv_transport="mooncake", kv_remote_bytes=16, kv_shm_dir=str(tmp_path))
    t = builtin_transport("mooncake", layout, tiny, metrics, torch.device("cpu"))
    assert t.remote is None and t.arena is None  # inline on gRPC
    assert metrics.plane_fallbacks.labels("mooncake", "no_arena")._value.get() == 1
    ok = WorkerOptions(kv_transport="mooncake", kv_remote_bytes=REGION_BYTES, kv_shm_dir=str(tmp_path))
    t = builtin_transport("mooncake", layout, ok, metrics, torch.device("cpu"))
    try:
        assert t.remote is not None and t.arena is t.remote.arena and t.doorbell is None
        assert t.remote.session.startswith(f"{default_host()}:")  # no --kv-mooncake-host: what the name resolves to
    finally:
        t.remote.close()
    with pytest.raises(ValueError, match="built-in planes are mooncake, cuda-ipc"):
        builtin_transport("nixl", layout, ok, metrics, torch.device("cpu"))


def test_a_session_a_write_failed_to_is_answered_inline_from_then_on():
    """A decode worker that named an address this prefill worker cannot reach (or that died):
    the failed write ends that hand-off, and later offers from that session go inline at once
    instead of failing each hand-off again."""
    from kvrelay.kvtransfer.metrics import WorkerMetrics
    from kvrelay.kvtransfer.planes import open_remote

    writer = MooncakeWriter("127.0.0.1")
    offer = kv_pb2.RemoteRegion(plane="mooncake", session="127.0.0.1:1", protocol="tcp", address=4096,
                                size=1 << 20)  # nothing listens on port 1
    target = writer.remote(offer, 1024)
    with pytest.raises(ConnectionError, match="gone or unreachable"):
        target.place(kv_pb2.KVChunk(), [np.zeros(1024, dtype=np.uint8)])
    metrics = WorkerMetrics()
    assert open_remote(writer, offer, 1024, metrics) is None
    assert metrics.plane_fallbacks.labels("mooncake", "unreachable")._value.get() == 1
    other = kv_pb2.RemoteRegion(plane="mooncake", session="127.0.0.1:2", protocol="tcp", address=4096, size=1 << 20)
    assert open_remote(writer, other, 1024, metrics) is not None  # other decode workers are still offered
