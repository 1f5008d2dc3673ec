"""The shared-memory data plane (decode worker's arena, kvrelay.kvtransfer.shm): same answers as a
single process, inline fallback whenever the prefill worker cannot use the offer, checks on
where chunks claim to lie, and the arena fully free again after every hand-off, failed or not."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.engine_args import EngineArgs
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.client import DecodeClient
from kvrelay.kvtransfer.errors import ChunkError
from kvrelay.kvtransfer.shm import (
    CREATING_GRACE_S,
    CREATING_PREFIX,
    DATA_START,
    DOORBELL_SUFFIX,
    PREFIX,
    Region,
    ShmArena,
    ShmOpener,
    remove_stale_arenas,
)
from kvrelay.kvtransfer.transport import _ShmReader
from kvrelay.kvtransfer.worker_base import WorkerOptions
from kvrelay.v1 import kv_pb2
from pd_helpers import (
    assert_all_free,
    assert_worker_free,
    free_port,
    metric_value,
    reference_tokens,
    scrape,
    start_pair,
    stop_pair,
    wait_until,
)
from test_pd_failures import PROMPT, SLOW_PREFILL, _handoff_started, _tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=5, max_tokens=12, ignore_eos=True, logprobs=2)


def _corrupting_place(header, data, region, offset):
    """place_chunk, then one bit of the placed bytes flips (after the prefill worker hashed them)."""
    from kvrelay.kvtransfer.chunk_wire import place_chunk

    msg = place_chunk(header, data, region, offset)
    region[offset] ^= 1
    return msg


def _corrupt_placed_chunks(monkeypatch) -> None:
    """Both places that put chunks in a region: the stream sender and the doorbell rings."""
    from kvrelay.prefill import engine_side, sender

    monkeypatch.setattr(sender, "place_chunk", _corrupting_place)
    monkeypatch.setattr(engine_side, "place_chunk", _corrupting_place)


def _offers(pair, outcome: str) -> float:
    return pair.prefill.metrics.shm_offers.labels(outcome)._value.get()


async def _shm_pair(tmp_path, shm_bytes: int = 4 << 20, streaming: bool = False):
    popts = WorkerOptions(max_message_bytes=16 * 1024, stream_min_tokens=0 if streaming else 10**9,
                          layer_group_size=1)
    dopts = WorkerOptions(max_message_bytes=16 * 1024, kv_shm_bytes=shm_bytes, kv_shm_dir=str(tmp_path))
    return await start_pair(prefill_options=popts, decode_options=dopts)


@pytest.mark.parametrize("streaming", [True, False], ids=["layer_streamed", "after_prefill"])
async def test_shm_handoff_equals_single_process(tmp_path, streaming):
    pair = await _shm_pair(tmp_path, streaming=streaming)
    ref = AsyncEngine(EngineArgs(num_kv_blocks=96))
    await ref.start()
    try:
        rng = random.Random(2)
        prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 16, 300)]
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
        # The 16-token prompt's second run finds its one block in the decode worker's prefix cache:
        # nothing to send, so no region is offered.
        assert _offers(pair, "accepted") == runs - 1 and _offers(pair, "unreachable") == 0
        assert pair.decode.metrics.kv_bytes._value.get() > 16 * 1024  # many chunks' worth
        arena = pair.decode.arena
        assert arena.free_bytes == arena.capacity
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)
        await ref.shutdown()
    assert not arena.path.exists()  # unlinked at stop


@pytest.mark.parametrize("why", ["file_gone", "other_file", "arena_full"])
async def test_inline_fallback_when_the_offer_cannot_be_used(tmp_path, why):
    """Another node (the file is not there), a different file under that name (nonce differs), or
    an arena too small for the prompt: the K/V goes inline, and the answer is the same."""
    pair = await _shm_pair(tmp_path, shm_bytes=64 * 1024 if why == "arena_full" else 4 << 20)
    arena = pair.decode.arena
    try:
        if why == "file_gone":
            arena.close()
        elif why == "other_file":
            arena.nonce = bytes(16)  # offers now name a nonce the file does not begin with
        want = await reference_tokens(PROMPT, SEEDED)
        got = await _tokens(pair.client.generate(PROMPT, SEEDED, prefill_addr=pair.prefill_addr))
        assert got == want
        assert pair.decode.metrics.kv_bytes._value.get() > 0
        assert pair.decode.metrics.fallbacks.labels("local")._value.get() == 0
        assert _offers(pair, "accepted") == 0
        assert _offers(pair, "unreachable") == (0 if why == "arena_full" else 1)
        assert arena.free_bytes == arena.capacity
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)


async def test_corrupted_shm_chunk_is_detected_never_used(tmp_path, monkeypatch):
    """Bytes changed in the region after the prefill worker hashed them fail the checksum; the
    decode worker drops the attempt and prefills locally."""
    _corrupt_placed_chunks(monkeypatch)
    pair = await _shm_pair(tmp_path)
    try:
        want = await reference_tokens(PROMPT[:100], SEEDED)
        assert await _tokens(pair.client.generate(PROMPT[:100], SEEDED, prefill_addr=pair.prefill_addr)) == want
        assert pair.decode.metrics.failures.labels("ChunkError")._value.get() == 1
        assert pair.decode.metrics.fallbacks.labels("local")._value.get() == 1
        assert pair.decode.arena.free_bytes == pair.decode.arena.capacity
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)


async def test_region_waits_out_a_quarantine_when_the_prefill_worker_never_confirms(tmp_path, monkeypatch):
    """A failed hand-off whose prefill worker does not end the call after the abort (hung, or
    deaf to it) might still be copying into the region: it returns to the arena only after the
    quarantine, never straight into another hand-off."""
    import kvrelay.prefill.worker as prefill_worker

    async def deaf_reader(self, it, h):  # reads the decode side's messages, reports none
        async for _ in it:
            pass
        await asyncio.Event().wait()

    _corrupt_placed_chunks(monkeypatch)
    monkeypatch.setattr(prefill_worker.PrefillWorker, "_read_decode_side", deaf_reader)
    pair = await _shm_pair(tmp_path)
    pair.decode.transport.shm_quarantine_s = 1.0
    pair.decode.transport.abort_grace_s = 0.5  # production's: the prefill worker never answers here
    arena = pair.decode.arena
    try:
        want = await reference_tokens(PROMPT[:100], SEEDED)
        assert await _tokens(pair.client.generate(PROMPT[:100], SEEDED, prefill_addr=pair.prefill_addr)) == want
        assert arena.free_bytes < arena.capacity  # held back: the abort was never confirmed
        async def region_returned() -> bool:
            return arena.free_bytes == arena.capacity

        await wait_until(region_returned, timeout_s=10, what="the quarantined region to return")
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)


async def test_prefill_killed_mid_shm_transfer_frees_blocks_and_arena(spawn, tmp_path):
    victim = spawn("prefill", *SLOW_PREFILL)
    mport = free_port()
    decode = spawn("decode", "--max-message-bytes", "16KiB", "--metrics-port", str(mport), "--kv-shm-bytes",
                   "4MiB", "--kv-shm-dir", str(tmp_path))
    want = await reference_tokens(PROMPT, SEEDED)
    async with DecodeClient(decode.addr) as client:
        task = asyncio.create_task(_tokens(client.generate(PROMPT, SEEDED, "kill-shm", prefill_addr=victim.addr)))
        await _handoff_started(victim.addr)
        free_during = metric_value(scrape(mport), "kvrelay:kv_shm_free_bytes")
        victim.kill()
        assert await asyncio.wait_for(task, 30) == want  # prefilled locally
    page = scrape(mport)
    assert free_during < metric_value(page, "kvrelay:kv_shm_free_bytes") == (4 << 20) - DATA_START
    assert metric_value(page, "kvrelay:kv_transfer_fallbacks_total", 'kind="local"') == 1
    await assert_worker_free(decode.addr)


# ---- the pieces -----------------------------------------------------------------------------


def test_arena_allocates_first_fit_and_coalesces(tmp_path):
    arena = ShmArena(DATA_START + 40960, tmp_path)
    try:
        a, b, c = arena.allocate(4096), arena.allocate(5000), arena.allocate(4096)
        assert (a.offset, b.offset, c.offset) == (DATA_START, DATA_START + 4096, DATA_START + 3 * 4096)
        assert b.size == 8192  # rounded up to pages
        assert arena.allocate(40960) is None  # no run that long: the caller sends inline
        arena.free(a)
        arena.free(b)
        assert arena.allocate(3 * 4096).offset == DATA_START  # a and b merged into one run
        arena.free(Region(DATA_START, 3 * 4096))
        arena.free(c)
        assert arena.free_bytes == arena.capacity and len(arena._free) == 1
    finally:
        arena.close()
    with pytest.raises(ValueError, match="too small"):
        ShmArena(DATA_START, tmp_path)


def test_arena_that_does_not_fit_its_directory_is_a_clear_error(tmp_path):
    import os

    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(OSError, match="lower --kv-shm-bytes"):
        ShmArena(free * 4 + (1 << 40), tmp_path)
    assert not list(tmp_path.iterdir())  # nothing left behind


def test_arena_of_a_killed_decode_worker_is_removed_by_the_next_one(tmp_path):
    """SIGKILL leaves no chance to unlink: the next arena in the directory deletes files whose
    owner's lock is gone, and leaves a live worker's arena alone."""
    code = ("import sys, time; from kvrelay.kvtransfer.shm import ShmArena; "
            "from kvrelay.kvtransfer.doorbell import DoorbellServer; a = ShmArena(1 << 20, sys.argv[1]); "
            "DoorbellServer(str(a.path) + '.sock'); print(a.path, flush=True); time.sleep(120)")
    owners = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
              for _ in range(2)]
    try:
        dead, live = (Path(p.stdout.readline().strip()) for p in owners)
        owners[0].kill()
        owners[0].wait()
        assert dead.exists() and live.exists()
        dead_sock, live_sock = (p.with_name(p.name + DOORBELL_SUFFIX) for p in (dead, live))
        assert dead_sock.exists() and live_sock.exists()
        arena = ShmArena(1 << 20, tmp_path)
        try:
            assert arena.removed_stale == [dead, dead_sock]  # and its doorbell socket
            assert not dead.exists() and live.exists() and arena.path.exists() and live_sock.exists()
            assert remove_stale_arenas(tmp_path) == []  # ours is locked too
        finally:
            arena.close()
    finally:
        for p in owners:
            p.kill()
            p.wait()
    assert remove_stale_arenas(tmp_path) == [live, live_sock]
    assert list(tmp_path.iterdir()) == []
    # A doorbell socket whose arena is gone (its worker was killed between the two unlinks).
    orphan = tmp_path / f"{PREFIX}9-c{DOORBELL_SUFFIX}"
    orphan.write_bytes(b"")
    assert remove_stale_arenas(tmp_path) == [orphan]
    # Killed while creating (sizing a large arena takes a while): swept once clearly abandoned.
    fresh, old = tmp_path / (CREATING_PREFIX + "1-a"), tmp_path / (CREATING_PREFIX + "2-b")
    for p in (fresh, old):
        p.write_bytes(b"x")
    os.utime(old, (time.time() - 2 * CREATING_GRACE_S,) * 2)
    assert remove_stale_arenas(tmp_path) == [old]
    assert fresh.exists()  # may be microseconds from its creator's lock


def test_opener_maps_only_the_offered_file_and_region(tmp_path):
    arena = ShmArena(DATA_START + 8192, tmp_path)
    opener = ShmOpener()
    try:
        view = opener.open(str(arena.path), arena.nonce, DATA_START, 8192)
        view[:3] = [1, 2, 3]
        assert list(arena.view[DATA_START:DATA_START + 3]) == [1, 2, 3]  # the same memory
        assert opener.open(str(arena.path), bytes(16), DATA_START, 8192) is None  # nonce differs
        assert opener.open(str(arena.path), arena.nonce, DATA_START, 8193) is None  # past the end
        assert opener.open(str(arena.path), arena.nonce, 0, 16) is None  # over the nonce page
        assert opener.open(str(tmp_path / "missing"), arena.nonce, DATA_START, 16) is None
    finally:
        arena.close()
    assert opener.open("/nonexistent/x", arena.nonce, DATA_START, 16) is None
    assert not opener._maps  # the unlinked arena's mapping was dropped


def test_reader_takes_chunks_only_back_to_back_within_the_region(tmp_path):
    arena = ShmArena(DATA_START + 8192, tmp_path)
    try:
        reader = _ShmReader(arena, arena.allocate(8192))
        first = reader.payload(kv_pb2.KVChunk(shm_offset=0, shm_size=4096))
        assert isinstance(first, np.ndarray) and len(first) == 4096
        with pytest.raises(ChunkError, match="expected it to start at 4096"):
            reader.payload(kv_pb2.KVChunk(shm_offset=0, shm_size=4096))  # would overlap the first
        with pytest.raises(ChunkError, match="within the region"):
            reader.payload(kv_pb2.KVChunk(shm_offset=4096, shm_size=8192))
        with pytest.raises(ChunkError, match="inline data"):
            reader.payload(kv_pb2.KVChunk(shm_offset=4096, shm_size=4, data=b"abcd"))
    finally:
        arena.close()


def test_shm_flags_on_the_command_line():
    import argparse

    from kvrelay.kvtransfer.worker_base import add_worker_args, options_from_cli

    parser = argparse.ArgumentParser()
    add_worker_args(parser, "decode")
    opts = options_from_cli(parser.parse_args(["--port", "0", "--kv-shm-bytes", "256MiB", "--kv-shm-dir", "/x"]))
    assert (opts.kv_shm_bytes, opts.kv_shm_dir, opts.kv_doorbell) == (256 << 20, "/x", True)
    assert options_from_cli(parser.parse_args(["--port", "0", "--no-kv-doorbell"])).kv_doorbell is False
    assert options_from_cli(parser.parse_args(["--port", "0"])).kv_shm_bytes == 0  # off unless asked
