"""The doorbell (kvrelay.kvtransfer.doorbell): on the shared-memory plane, chunk headers,
PrefillDone and the ack go between the two engine threads on a Unix socket beside the arena.
Same answers as a single process, nothing on the gRPC stream but start, header, aborts and its
end, and every failure of the socket ends as a clean gRPC-side failure with nothing stranded."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time

import pytest
import torch
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.engine_args import EngineArgs
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.chunk_wire import block_pieces, pieces_checksum
from kvrelay.kvtransfer.doorbell import DoorbellClient, DoorbellHandoff, DoorbellServer
from kvrelay.kvtransfer.errors import ChunkError
from kvrelay.kvtransfer.layout import ChunkRange, DirectChunk, KVLayout
from kvrelay.kvtransfer.shm import DATA_START, SharedKVCache, SourceCaches
from kvrelay.kvtransfer.worker_base import WorkerOptions
from kvrelay.v1 import kv_pb2
from pd_helpers import assert_all_free, start_pair, stop_pair, wait_until

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=11, max_tokens=10, ignore_eos=True, logprobs=2)


async def _doorbell_pair(tmp_path, kv_doorbell: bool = True, **prefill):
    popts = WorkerOptions(max_message_bytes=16 * 1024, stream_min_tokens=200, layer_group_size=1,
                          kv_shm_dir=str(tmp_path), **prefill)
    dopts = WorkerOptions(max_message_bytes=16 * 1024, kv_shm_bytes=4 << 20, kv_shm_dir=str(tmp_path),
                          kv_doorbell=kv_doorbell)
    pair = await start_pair(prefill_options=popts, decode_options=dopts)
    assert (pair.decode.doorbell is not None) == kv_doorbell
    return pair


@contextlib.asynccontextmanager
async def _pair_and_reference(tmp_path, kv_doorbell: bool = True, **prefill):
    """A doorbell pair and a single-process engine to compare it with, both stopped after."""
    pair = await _doorbell_pair(tmp_path, kv_doorbell, **prefill)
    ref = AsyncEngine(EngineArgs(num_kv_blocks=96))
    await ref.start()
    try:
        yield pair, ref
    finally:
        await stop_pair(pair)
        await ref.shutdown()


async def _assert_falls_back_locally(pair, ref, prompt: list[int], params, caplog, why: str) -> None:
    """The hand-off fails with a ChunkError saying why; local prefill gives the same answer;
    nothing is stranded."""
    await _assert_same_as_single_process(pair, ref, prompt, params)
    assert _count(pair.decode.metrics.failures, "ChunkError") == 1
    assert _count(pair.decode.metrics.fallbacks, "local") == 1
    assert why in caplog.text
    await assert_all_free(pair.prefill.engine, pair.decode.engine)


async def _assert_same_as_single_process(pair, ref: AsyncEngine, prompt: list[int], params) -> None:
    got = await _outputs(pair.client.generate(prompt, params, prefill_addr=pair.prefill_addr))
    assert _tokens_and_logprobs(got) == _tokens_and_logprobs(await _outputs(ref.generate(prompt, params)))


def _ack_delays(metrics) -> float:
    return next(s.value for s in metrics.doorbell_ack_delay.collect()[0].samples if s.name.endswith("_count"))


def _count(counter, *labels) -> float:
    return (counter.labels(*labels) if labels else counter)._value.get()


async def _outputs(stream):
    return [o async for o in stream]


def _tokens_and_logprobs(outputs):
    return ([t for o in outputs for t in o.new_token_ids],
            [(lp.token_id, lp.logprob, lp.top) for o in outputs for lp in o.logprobs or []])


async def test_doorbell_hand_off_equals_single_process(tmp_path):
    """Prompts under and over stream_min_tokens (chunks rung from the layer hook while later
    layers compute), greedy and seeded: each hand-off is rung and acked on the doorbell."""
    async with _pair_and_reference(tmp_path) as (pair, ref):
        rng = random.Random(8)
        prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (7, 120, 300)]
        for prompt in prompts:
            for params in (GREEDY, SEEDED):
                await _assert_same_as_single_process(pair, ref, prompt, params)
        m = pair.prefill.metrics
        # The seeded runs find their prompt's full blocks in the decode worker's prefix cache; the
        # 7-token prompt has none, so each run hands off something.
        assert _count(m.doorbells, "connected") == 6 and _count(m.doorbells, "unreachable") == 0
        assert _count(m.kv_handoffs, "ack") == 6, [(s.labels, s.value) for s in m.kv_handoffs.collect()[0].samples]
        assert m.kv_send_seconds._sum.get() > 0
        # Timed to the write the doorbell ack stamps, not to reading it: its way back is apart.
        # (Under load the stream's ack, sent next, can win the race; it carries no stamp.)
        assert _ack_delays(m) >= 1
        assert _count(m.kv_overlap_bytes) == 0  # prefill side never counts it; the decode side does
        assert _count(pair.decode.metrics.kv_overlap_bytes) > 0  # the 300-token prompt was layer-streamed
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
        assert pair.decode.arena.free_bytes == pair.decode.arena.capacity
        sock = pair.decode.doorbell.path
    assert not sock.exists()  # unlinked at stop


async def test_broken_doorbell_fails_over_the_stream_and_strands_nothing(tmp_path):
    """The decode worker's doorbell goes away mid-hand-off: the prefill worker's next ring fails,
    it aborts on the stream, the decode worker prefills locally (the same answer), and a later
    hand-off, finding no socket, signals on gRPC."""
    async with _pair_and_reference(tmp_path, debug_chunk_delay_s=0.2) as (pair, ref):
        prompt = list(range(40, 190))
        want = _tokens_and_logprobs(await _outputs(ref.generate(prompt, SEEDED)))
        task = asyncio.create_task(_outputs(pair.client.generate(prompt, SEEDED, prefill_addr=pair.prefill_addr)))
        await wait_until(lambda: _count(pair.prefill.metrics.doorbells, "connected") == 1, what="a rung hand-off")
        await asyncio.sleep(0.3)  # a chunk or two are through
        pair.decode.doorbell.close()
        assert _tokens_and_logprobs(await asyncio.wait_for(task, 30)) == want
        assert _count(pair.decode.metrics.fallbacks, "local") == 1
        assert _count(pair.prefill.metrics.kv_handoffs, "error") == 1
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
        assert pair.decode.arena.free_bytes == pair.decode.arena.capacity

        await _assert_same_as_single_process(pair, ref, list(range(200, 260)), GREEDY)
        assert _count(pair.prefill.metrics.doorbells, "unreachable") == 1
        assert _count(pair.prefill.metrics.kv_handoffs, "ack") == 1
        await assert_all_free(pair.prefill.engine, pair.decode.engine)


async def test_without_the_doorbell_hand_offs_signal_on_the_stream(tmp_path):
    async with _pair_and_reference(tmp_path, kv_doorbell=False) as (pair, ref):
        assert [p.name for p in tmp_path.iterdir()] == [pair.decode.arena.path.name]  # no socket
        await _assert_same_as_single_process(pair, ref, list(range(50, 130)), SEEDED)
        m = pair.prefill.metrics
        assert _count(m.shm_offers, "accepted") == 1 and _count(m.kv_handoffs, "ack") == 1
        assert _count(m.doorbells, "connected") == _count(m.doorbells, "unreachable") == 0
        await assert_all_free(pair.prefill.engine, pair.decode.engine)


async def test_lost_doorbell_ack_is_covered_by_the_stream_ack(tmp_path, monkeypatch):
    monkeypatch.setattr(DoorbellServer, "_ack", lambda self, conn, h: None)
    async with _pair_and_reference(tmp_path) as (pair, ref):
        await _assert_same_as_single_process(pair, ref, list(range(30, 130)), GREEDY)
        assert _count(pair.prefill.metrics.doorbells, "connected") == 1
        assert _count(pair.prefill.metrics.kv_handoffs, "ack") == 1
        await assert_all_free(pair.prefill.engine, pair.decode.engine)


async def test_stream_ending_right_after_the_doorbell_ack_does_not_fail_the_hand_off(tmp_path, monkeypatch):
    """The doorbell ack lets the prefill worker end the stream at once. A doorbell thread held up
    right after sending it (the GIL, a loaded machine) must not let that end, seen first on the
    event loop, fail a hand-off that is complete (it once fell back to a local prefill)."""
    send_ack = DoorbellServer._ack

    def ack_then_stall(self, conn, h):
        send_ack(self, conn, h)
        time.sleep(0.5)  # the prefill worker reads the ack and closes the stream meanwhile

    monkeypatch.setattr(DoorbellServer, "_ack", ack_then_stall)
    async with _pair_and_reference(tmp_path) as (pair, ref):
        await _assert_same_as_single_process(pair, ref, list(range(30, 130)), GREEDY)
        assert _count(pair.decode.metrics.fallbacks, "local") == 0
        assert _count(pair.decode.metrics.kv_handoffs, "ack") == 1
        await assert_all_free(pair.prefill.engine, pair.decode.engine)


async def test_frames_reach_only_a_live_hand_off_and_a_bad_header_writes_nothing(tmp_path):
    """Real sockets and threads; the writes are recorded instead of going into a cache."""
    loop = asyncio.get_running_loop()
    ran: list[str] = []
    server = DoorbellServer(tmp_path / "bell.sock")
    acks: list[tuple] = []
    client = DoorbellClient(lambda ticket, read_at, written_at: acks.append((ticket, read_at, written_at)))

    def handoff(name: str, bad: bool = False) -> DoorbellHandoff:
        def accept(chunk, source):
            if bad:
                raise ChunkError(f"{name}: bad header")
            return name

        h = DoorbellHandoff(name.encode(), accept, lambda: None, lambda chunks: ran.append(f"{name}:{len(chunks)}"),
                            loop, loop.create_future())
        server.register(h)
        return h

    try:
        gone, bad, live = handoff("gone"), handoff("bad", bad=True), handoff("live")
        server.unregister(gone)
        conn = client.connect(str(server.path))
        chunk = kv_pb2.KVChunk(layer_start=0, layer_end=1)
        done = kv_pb2.PrefillDone(first_token_id=42)
        for ticket in (b"gone", b"unknown", b"bad"):
            assert conn.ring(kv_pb2.DoorbellFrame(ticket=ticket, chunks=[chunk], done=done))
        assert conn.ring(kv_pb2.DoorbellFrame(ticket=b"live", chunks=[chunk, chunk]))
        assert conn.ring(kv_pb2.DoorbellFrame(ticket=b"live", chunks=[chunk], done=done))
        assert (await asyncio.wait_for(live.future, 5)).first_token_id == 42
        with pytest.raises(ChunkError, match="bad header"):
            await asyncio.wait_for(bad.future, 5)
        assert ran == ["live:2", "live:1"]  # nothing for the given-up, unknown or bad hand-off
        await wait_until(lambda: [a[0] for a in acks] == [b"live"], what="the ack")
        (_, read_at, written_at), = acks
        assert written_at == pytest.approx(live.written_at, abs=1e-6) and written_at <= read_at  # one clock
        assert not gone.future.done()
    finally:
        client.close()
        server.close()
    assert not server.path.exists()
    assert threading.active_count() < 50


async def test_direct_hand_off_copies_from_the_prefill_workers_cache_and_equals_single_process(tmp_path):
    """--kv-shared-cache: the decode worker copies the held blocks straight out of the prefill
    worker's cache file (read-only), layer-streamed chunks included; nothing goes through the
    region, the answers equal a single process, and the cache file goes at stop."""
    async with _pair_and_reference(tmp_path, kv_shared_cache=True) as (pair, ref):
        cache_file = pair.prefill.shared_cache.arena.path
        assert cache_file.exists() and cache_file.stat().st_mode & 0o777 == 0o600
        region = pair.decode.arena.view[DATA_START:]
        region[:] = 0x5A  # a direct hand-off never writes the region: it stays this pattern
        rng = random.Random(9)
        for n in (7, 120, 300):
            prompt = [rng.randrange(3, 512) for _ in range(n)]
            for params in (GREEDY, SEEDED):
                await _assert_same_as_single_process(pair, ref, prompt, params)
        m = pair.prefill.metrics
        assert _count(m.direct) == _count(m.doorbells, "connected") == 6
        assert _count(m.kv_handoffs, "ack") == 6, [(s.labels, s.value) for s in m.kv_handoffs.collect()[0].samples]
        assert _count(pair.decode.metrics.kv_overlap_bytes) > 0  # the 300-token prompt was layer-streamed
        assert (region == 0x5A).all()
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    assert not cache_file.exists()


async def test_direct_chunk_whose_source_changed_fails_the_check_and_falls_back(tmp_path, monkeypatch, caplog):
    """The prefill worker's blocks change between its hash and the decode worker's copy (as a
    lease that expired could let them be reused): the checksum of what landed in the decode
    worker's blocks fails, the hand-off fails, the decode worker prefills locally (same answer),
    and nothing is stranded."""
    from kvrelay.kvtransfer import layout

    real_copy = layout.native_ops.copy_blocks

    def copy_then_flip(dst, dst_ids, src, src_ids, lo, hi):
        real_copy(dst, dst_ids, src, src_ids, lo, hi)
        dst[lo, 0, int(dst_ids[0])].view(-1)[0] += 1.0  # as if the source changed under the copy

    monkeypatch.setattr(layout.native_ops, "copy_blocks", copy_then_flip)
    async with _pair_and_reference(tmp_path, kv_shared_cache=True) as (pair, ref):
        await _assert_falls_back_locally(pair, ref, list(range(60, 160)), SEEDED, caplog,
                                         "checksum mismatch after the direct copy")
        assert _count(pair.prefill.metrics.direct) == 1


async def test_direct_hand_off_needs_the_decode_workers_offer(tmp_path):
    """A decode worker that cannot read a shared cache (GPU cache, or an older version) does not
    offer it: a prefill worker with one places the K/V in the region as before."""
    async with _pair_and_reference(tmp_path, kv_shared_cache=True) as (pair, ref):
        pair.decode.transport.sources = None
        await _assert_same_as_single_process(pair, ref, list(range(20, 120)), GREEDY)
        m = pair.prefill.metrics
        assert _count(m.direct) == 0 and _count(m.doorbells, "connected") == 1 and _count(m.kv_handoffs, "ack") == 1
        await assert_all_free(pair.prefill.engine, pair.decode.engine)


async def test_direct_hand_off_whose_cache_file_is_gone_falls_back(tmp_path, caplog):
    """The decode worker cannot map the prefill worker's cache (here: its file was removed, as on
    another mount): a clear ChunkError before any copy, local prefill, nothing stranded."""
    async with _pair_and_reference(tmp_path, kv_shared_cache=True) as (pair, ref):
        pair.prefill.shared_cache.arena.path.unlink()  # the engine keeps its mapping
        await _assert_falls_back_locally(pair, ref, list(range(70, 150)), GREEDY, caplog,
                                         "cannot map the prefill worker's shared KV cache")


async def test_direct_chunks_are_checked_against_the_checksums_that_follow(tmp_path):
    """The prefill worker sends a direct chunk's checksum after its header (it hashes while the
    decode worker copies): the right one completes the hand-off; a wrong one, none before done,
    or one for no chunk fails it. Real sockets, threads and copies between two small caches."""
    loop = asyncio.get_running_loop()
    server = DoorbellServer(tmp_path / "bell.sock")
    client = DoorbellClient(lambda ticket, read_at, written_at: None)
    src = torch.randn(2, 2, 4, 4, 1, 8)
    good = pieces_checksum(block_pieces(src.view(torch.uint8).numpy(), [1, 2], 0, 2))

    def handoff(name: str) -> DoorbellHandoff:
        dst = torch.zeros_like(src)

        def write(chunks):
            for c in chunks:
                c.copy_into(dst, [3, 0])

        h = DoorbellHandoff(name.encode(), lambda chunk, source: DirectChunk(ChunkRange(0, 2, 0, 2), src, [1, 2]),
                            lambda: None, write, loop, loop.create_future())
        server.register(h)
        return h

    try:
        ok, wrong, missing, extra = (handoff(n) for n in ("ok", "wrong", "missing", "extra"))
        conn = client.connect(str(server.path))
        chunk, done = kv_pb2.KVChunk(layer_start=0, layer_end=2), kv_pb2.PrefillDone(first_token_id=7)
        for ticket, checksums in ((b"ok", [good]), (b"wrong", [good ^ 1])):
            assert conn.ring(kv_pb2.DoorbellFrame(ticket=ticket, chunks=[chunk]))
            assert conn.ring(kv_pb2.DoorbellFrame(ticket=ticket, checksums=checksums, done=done))
        assert conn.ring(kv_pb2.DoorbellFrame(ticket=b"missing", chunks=[chunk], done=done))
        assert conn.ring(kv_pb2.DoorbellFrame(ticket=b"extra", checksums=[good], done=done))
        assert (await asyncio.wait_for(ok.future, 5)).first_token_id == 7
        for h, message in ((wrong, "checksum mismatch after the direct copy"), (missing, "never got their checksums"),
                           (extra, "checksum for no direct KV chunk")):
            with pytest.raises(ChunkError, match=message):
                await asyncio.wait_for(h.future, 5)
    finally:
        client.close()
        server.close()


def test_source_caches_check_the_file_and_let_go_of_gone_ones(tmp_path):
    """The decode side's read-only mappings of prefill workers' caches: the nonce and the layout
    are checked, and a cache whose file is gone stays mapped (a copy may still read it) until
    prune, which runs at each direct-capable hand-off."""
    layout = KVLayout("m", "r", "float32", 4, 2, 1, 8)
    shared = SharedKVCache(tmp_path)
    mine = shared(3 * layout.bytes_per_block_layer * layout.num_layers).view(torch.float32)
    mine[:] = 1.5
    offer = shared.offer()
    sources = SourceCaches(layout)
    src = sources.open(offer)
    assert src.shape == (2, 2, 3, 4, 1, 8) and bool((src == 1.5).all())
    other = SourceCaches(layout)
    with pytest.raises(OSError, match="nonce differs"):
        other.open(kv_pb2.ShmRegion(path=offer.path, nonce=b"x" * 16, offset=offer.offset, size=offer.size))
    with pytest.raises(OSError, match="not a KV cache of this layout"):
        other.open(kv_pb2.ShmRegion(path=offer.path, nonce=offer.nonce, offset=offer.offset, size=offer.size - 4))
    shared.close()  # the prefill worker stopped: its file is unlinked
    assert sources.open(offer) is src
    sources.prune()
    with pytest.raises(FileNotFoundError):
        sources.open(offer)
