"""The CUDA IPC data plane (kvrelay.kvtransfer.cuda_ipc). Without a GPU: its checksum, its copy and
check, which side offers and answers when, the fallbacks, and the whole protocol between real gRPC
workers with the handle's opening replaced by the prefill worker's CPU cache itself (the copy is
then host to host, everything else as on GPUs). With a GPU: the real handle, same tokens as a
single process."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.engine_args import EngineArgs
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer import cuda_ipc
from kvrelay.kvtransfer.client import DecodeClient
from kvrelay.kvtransfer.cuda_ipc import CudaIpcExport, CudaIpcSources, IpcChunk, device_checksum
from kvrelay.kvtransfer.errors import ChunkError
from kvrelay.kvtransfer.layout import ChunkRange, ChunkVerifier, KVLayout, chunk_header
from kvrelay.kvtransfer.metrics import WorkerMetrics
from kvrelay.kvtransfer.shm import LockedFile, doorbell_path
from kvrelay.kvtransfer.worker_base import WorkerOptions
from kvrelay.v1 import kv_pb2
from pd_helpers import (
    BUNDLED_MODEL,
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
from test_pd_early_start import prefill_done_before_reservation
from test_pd_failures import PROMPT, SLOW_PREFILL, _handoff_started, _tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=5, max_tokens=12, ignore_eos=True, logprobs=2)
LAYOUT = KVLayout("m", "r", "float32", block_size=4, num_layers=3, num_kv_heads=2, head_dim=8)


def _fallbacks(metrics, reason: str) -> float:
    return metrics.plane_fallbacks.labels("cuda-ipc", reason)._value.get()


def _cache(num_blocks: int = 10, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(LAYOUT.num_layers, 2, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim,
                       generator=g)


def test_device_checksum_catches_flipped_bits_and_moved_words():
    t = _cache()
    base = device_checksum(t)
    assert device_checksum(t.clone()) == base and 0 <= base < 2**64
    words = t.view(torch.int32).reshape(-1)
    for i, bit in ((0, 0), (77, 31), (words.numel() - 1, 13)):
        flipped = t.clone()
        flipped.view(torch.int32).reshape(-1)[i] ^= 1 << bit
        assert device_checksum(flipped) != base
    swapped = t.clone()
    w = swapped.view(torch.int32).reshape(-1)
    w[[3, 4]] = w[[4, 3]]
    assert device_checksum(swapped) != base
    assert device_checksum(torch.arange(7, dtype=torch.uint8)) != device_checksum(torch.arange(6, dtype=torch.uint8))


def test_ipc_chunk_copies_the_held_blocks_and_checks_what_landed():
    source, dest = _cache(seed=1), torch.zeros(LAYOUT.num_layers, 2, 12, 4, 2, 8)
    r = ChunkRange(1, 3, 0, 3)
    held, reserved = [7, 2, 5], [0, 9, 4]
    expected = device_checksum(source[1:3].index_select(2, torch.tensor(held)))
    chunk = IpcChunk(r, source, held)
    chunk.expected = expected
    chunk.copy_into(dest, reserved)
    for src_b, dst_b in zip(held, reserved, strict=True):
        assert torch.equal(dest[1:3, :, dst_b], source[1:3, :, src_b])
    assert not dest[0].any()  # layers outside the range untouched
    bad = IpcChunk(r, source, held)
    bad.expected = expected ^ 1
    with pytest.raises(ChunkError, match="checksum mismatch after the direct copy"):
        bad.copy_into(dest, reserved)


def test_prefill_side_answers_only_with_a_gpu_cache_on_the_offering_node(monkeypatch):
    metrics = WorkerMetrics()
    cpu = CudaIpcExport(SimpleNamespace(kv_cache=_cache()), "node-a", metrics)
    assert cpu.answer(kv_pb2.CudaIpcOffer(node="node-a")) is None
    assert _fallbacks(metrics, "cpu_cache") == 1

    gpu_like = SimpleNamespace(kv_cache=SimpleNamespace(device=torch.device("cuda", 0)))
    export = CudaIpcExport(gpu_like, "node-a", metrics)
    assert export.answer(kv_pb2.CudaIpcOffer(node="node-b")) is None
    assert _fallbacks(metrics, "other_node") == 1

    handle = kv_pb2.CudaIpcCache(handle=b"h", nonce=b"n" * 16)
    calls = []
    monkeypatch.setattr(cuda_ipc, "export_handle", lambda cache: calls.append(cache) or handle)
    assert export.answer(kv_pb2.CudaIpcOffer(node="node-a")) == handle
    assert export.answer(kv_pb2.CudaIpcOffer(node="")) == handle  # a decode worker that does not know its node
    assert len(calls) == 1 and metrics.plane_handoffs.labels("cuda-ipc")._value.get() == 2

    def no_ipc(cache):
        raise RuntimeError("expandable segments do not support IPC")

    monkeypatch.setattr(cuda_ipc, "export_handle", no_ipc)
    fresh = CudaIpcExport(gpu_like, "node-a", metrics)
    assert fresh.answer(kv_pb2.CudaIpcOffer(node="node-a")) is None
    assert _fallbacks(metrics, "export_failed") == 1


def test_decode_side_stops_offering_to_a_prefill_worker_whose_handle_did_not_open():
    metrics = WorkerMetrics()

    def refuse(msg, dtype):
        raise RuntimeError("cudaIpcOpenMemHandle: invalid device context")

    sources = CudaIpcSources(LAYOUT, torch.device("cpu"), "node-a", metrics, opener=refuse)
    assert sources.offer("p:1") == kv_pb2.CudaIpcOffer(node="node-a", device_index=0)
    msg = kv_pb2.CudaIpcCache(shape=[3, 2, 10, 4, 2, 8], nonce=b"x" * 16)
    with pytest.raises(ChunkError, match="cannot open the CUDA IPC handle of p:1"):
        sources.open("p:1", msg)
    assert sources.offer("p:1") is None and sources.offer("p:2") is not None
    assert _fallbacks(metrics, "open_failed") == 1

    cache = _cache()
    opened = CudaIpcSources(LAYOUT, torch.device("cpu"), "", metrics, opener=lambda m, d: cache)
    with pytest.raises(ChunkError, match="is not"):  # another model's cache shape
        opened.open("p:3", kv_pb2.CudaIpcCache(shape=[3, 2, 10, 4, 4, 8], nonce=b"y" * 16))
    assert opened.open("p:4", msg) is cache and opened.open("p:4", msg) is cache  # opened once per nonce

    verifier = ChunkVerifier(LAYOUT, num_tokens=12, num_blocks=3)
    header = chunk_header(LAYOUT.to_proto(), ChunkRange(0, 3, 0, 3), 12)
    with pytest.raises(ChunkError, match="names no source blocks"):
        opened.accept(verifier, header, cache)
    header.source_block_ids.extend([1, 2, 99])
    with pytest.raises(ChunkError, match="outside"):
        opened.accept(verifier, header, cache)


async def test_cuda_ipc_on_a_cpu_decode_worker_falls_back_to_inline():
    pair = await start_pair(decode_options=WorkerOptions(kv_transport="cuda-ipc"))
    try:
        assert pair.decode.transport.cuda_ipc is None
        assert _fallbacks(pair.decode.metrics, "cpu_cache") == 1
        want = await reference_tokens(PROMPT[:100], SEEDED)
        assert await _tokens(pair.client.generate(PROMPT[:100], SEEDED, prefill_addr=pair.prefill_addr)) == want
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)


async def _cpu_ipc_pair(monkeypatch, streaming: bool, corrupt: bool = False, doorbell_dir=None, opener=None,
                        **prefill):
    """Real workers on the CUDA IPC protocol with CPU caches: the prefill worker answers as a GPU
    one would, and the decode worker's opener returns the prefill worker's cache tensor.
    doorbell_dir: the decode worker offers its doorbell there, as a GPU one does by default."""
    monkeypatch.setattr(CudaIpcExport, "refusal", lambda self, offer: None)
    monkeypatch.setattr(cuda_ipc, "export_handle",
                        lambda cache: kv_pb2.CudaIpcCache(shape=list(cache.shape), nonce=b"c" * 16))
    popts = WorkerOptions(stream_min_tokens=0 if streaming else 10**9, layer_group_size=2, **prefill)
    dopts = WorkerOptions(kv_shm_dir=str(doorbell_dir or "/dev/shm"))
    pair = await start_pair(prefill_options=popts, decode_options=dopts)
    cache = pair.prefill.llm.kv_cache

    def same_or_changed(msg, dtype):
        if not corrupt:
            return cache
        changed = cache.clone()
        changed.view(torch.int32).reshape(-1)[:: 1 << 16] ^= 1  # what the decode worker reads differs
        return changed

    t = pair.decode.transport
    t.cuda_ipc = CudaIpcSources(t.layout, torch.device("cpu"), "", pair.decode.metrics,
                                opener=opener or same_or_changed)
    if doorbell_dir is not None:
        t.doorbell = pair.decode.doorbell = pair.decode._open_ipc_doorbell()
        assert t.doorbell is not None
    return pair


@pytest.mark.parametrize("doorbell", [False, True], ids=["stream", "doorbell"])
@pytest.mark.parametrize("streaming", [True, False], ids=["layer_streamed", "after_prefill"])
async def test_cuda_ipc_protocol_equals_single_process(monkeypatch, tmp_path, streaming, doorbell):
    """doorbell: the chunk headers (held blocks, checksum, the handle) and PrefillDone come on the
    decode worker's socket from the prefill worker's ringer thread, and the decode worker's
    doorbell thread copies and checks them; the gRPC stream carries start, header and its end."""
    pair = await _cpu_ipc_pair(monkeypatch, streaming, doorbell_dir=tmp_path if doorbell else None)
    ref = AsyncEngine(EngineArgs(num_kv_blocks=96))
    await ref.start()
    try:
        rng = random.Random(4)
        prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 300)]
        prompts.append(prompts[-1][:200] + [9, 9, 9])  # a prefix-cache hit on the prefill side
        for prompt in prompts:
            for params in (GREEDY, SEEDED):
                got = [o async for o in pair.client.generate(prompt, params, prefill_addr=pair.prefill_addr)]
                want = [o async for o in ref.generate(prompt, params)]
                assert [o.new_token_ids for o in got] == [o.new_token_ids for o in want]
        assert pair.prefill.metrics.plane_handoffs.labels("cuda-ipc")._value.get() >= 4
        assert pair.decode.metrics.fallbacks.labels("local")._value.get() == 0
        moved = pair.decode.metrics.kv_bytes._value.get()
        assert moved > 0 and pair.decode.metrics.kv_plane_bytes.labels("cuda-ipc")._value.get() == moved
        # Every hand-off rang: a header that says so makes the decode side wait for the socket only.
        assert pair.prefill.metrics.doorbells.labels("connected")._value.get() == (6 if doorbell else 0)
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)
        await ref.shutdown()



@pytest.mark.parametrize("doorbell", [False, True], ids=["stream", "doorbell"])
async def test_cuda_ipc_chunk_whose_bytes_differ_is_caught_and_falls_back(monkeypatch, tmp_path, doorbell):
    pair = await _cpu_ipc_pair(monkeypatch, streaming=False, corrupt=True, doorbell_dir=tmp_path if doorbell else None)
    try:
        want = await reference_tokens(PROMPT, SEEDED)
        assert await _tokens(pair.client.generate(PROMPT, SEEDED, prefill_addr=pair.prefill_addr)) == want
        assert pair.decode.metrics.failures.labels("ChunkError")._value.get() == 1
        assert pair.decode.metrics.fallbacks.labels("local")._value.get() == 1
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)


async def test_ipc_handle_that_does_not_open_on_the_doorbell_falls_back_and_is_offered_no_more(monkeypatch, tmp_path):
    """The decode worker's doorbell thread cannot open the handle in the first frame: that hand-off
    fails (ChunkError) and prefills locally; the next one gets no CUDA IPC offer, so it goes
    inline, without the doorbell. Same answers, nothing stranded."""
    def refuse(msg, dtype):
        raise RuntimeError("cudaIpcOpenMemHandle failed: invalid device context")

    pair = await _cpu_ipc_pair(monkeypatch, streaming=False, doorbell_dir=tmp_path, opener=refuse)
    try:
        for prompt in (PROMPT[:90], PROMPT[:120]):
            want = await reference_tokens(prompt, SEEDED)
            assert await _tokens(pair.client.generate(prompt, SEEDED, prefill_addr=pair.prefill_addr)) == want
        d, p = pair.decode.metrics, pair.prefill.metrics
        assert _fallbacks(d, "open_failed") == 1 and d.failures.labels("ChunkError")._value.get() == 1
        assert d.fallbacks.labels("local")._value.get() == 1
        assert p.doorbells.labels("connected")._value.get() == 1  # the second was not offered the plane
        assert d.kv_plane_bytes.labels("grpc")._value.get() > 0
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)


async def test_broken_ipc_doorbell_fails_over_the_stream_and_strands_nothing(monkeypatch, tmp_path):
    """The decode worker's doorbell goes away while layer groups are being rung: the prefill
    worker's next ring fails, it aborts on the stream, the decode worker prefills locally (the same
    answer); the next hand-off finds no socket and rings on gRPC."""
    pair = await _cpu_ipc_pair(monkeypatch, streaming=True, doorbell_dir=tmp_path, debug_chunk_delay_s=0.2)
    try:
        want = await reference_tokens(PROMPT, SEEDED)
        task = asyncio.create_task(_tokens(pair.client.generate(PROMPT, SEEDED, prefill_addr=pair.prefill_addr)))
        connected = pair.prefill.metrics.doorbells.labels("connected")

        async def rung():
            return connected._value.get() == 1

        await wait_until(rung, what="a hand-off on the doorbell")
        await asyncio.sleep(0.3)  # a frame or two are through
        pair.decode.doorbell.close()
        assert await asyncio.wait_for(task, 30) == want
        assert pair.decode.metrics.fallbacks.labels("local")._value.get() == 1
        assert pair.prefill.metrics.kv_handoffs.labels("error")._value.get() == 1
        await assert_all_free(pair.prefill.engine, pair.decode.engine)

        want = await reference_tokens(PROMPT[:60], GREEDY)
        assert await _tokens(pair.client.generate(PROMPT[:60], GREEDY, prefill_addr=pair.prefill_addr)) == want
        assert pair.prefill.metrics.doorbells.labels("unreachable")._value.get() == 1
        assert pair.decode.metrics.kv_plane_bytes.labels("cuda-ipc")._value.get() > 0  # over the stream
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)


def test_ipc_doorbell_of_a_killed_decode_worker_is_swept_by_the_next_one(tmp_path):
    """Without an arena, the CUDA IPC plane's socket sits beside an empty locked file
    (LockedFile): after kill -9 the next decode worker in the directory deletes both."""
    code = ("import sys, time; from kvrelay.kvtransfer.shm import LockedFile, doorbell_path; "
            "from kvrelay.kvtransfer.doorbell import DoorbellServer; a = LockedFile(sys.argv[1]); "
            "DoorbellServer(doorbell_path(a.path)); print(a.path, flush=True); time.sleep(120)")
    owner = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        dead = Path(owner.stdout.readline().strip())
        live = LockedFile(tmp_path)
        assert live.removed_stale == [] and dead.exists()  # its owner holds the lock
    finally:
        owner.kill()
        owner.wait()
    dead_sock = doorbell_path(dead)
    assert dead_sock.exists()
    again = LockedFile(tmp_path)
    assert again.removed_stale == [dead, dead_sock] and live.path.exists()
    for a in (live, again):
        a.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("doorbell", [False, True], ids=["stream", "doorbell"])
async def test_cuda_ipc_chunks_that_come_before_the_reservation_wait_for_it(monkeypatch, tmp_path, doorbell):
    """Early start on the CUDA IPC protocol: the decode worker's engine thread is held (a long step)
    until the prefill worker has computed and sent every chunk header; the copies wait for the
    reservation (in the doorbell thread, or in the stream), then land: single-process tokens."""
    pair = await _cpu_ipc_pair(monkeypatch, streaming=False, doorbell_dir=tmp_path if doorbell else None)
    try:
        prompt = [random.Random(8).randrange(3, 512) for _ in range(90)]
        got = await prefill_done_before_reservation(pair, prompt, GREEDY, "early")
        assert got == await reference_tokens(prompt, GREEDY)
        assert pair.decode.metrics.fallbacks.labels("local")._value.get() == 0
        assert pair.decode.metrics.kv_plane_bytes.labels("cuda-ipc")._value.get() > 0
        assert pair.prefill.metrics.doorbells.labels("connected")._value.get() == (1 if doorbell else 0)
        await assert_all_free(pair.prefill.engine, pair.decode.engine)
    finally:
        await stop_pair(pair)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("checksum", [False, True], ids=["to_host", "checksum"])
def test_copy_stream_gathers_after_the_queued_writes_without_waiting_for_them(checksum):  # pragma: no cover
    """The prefill worker's copy stream: its gathers see every K/V write queued before them on the
    compute stream, yet the call returns while that compute still runs (the engine thread goes on)."""
    from kvrelay.kernels import reference
    from kvrelay.prefill.copy_stream import CopyStream

    ops = SimpleNamespace(gather_blocks=reference.gather_blocks)
    cache = _cache().cuda()
    table = [1, 4, 7]
    ranges = [ChunkRange(0, 2, 0, 2), ChunkRange(2, 3, 0, 3)]
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time queued on the compute stream
    cache[:, :, 4] += 1.0  # a K/V write queued behind it
    chunks = CopyStream(cache.device).gather(ops, cache, table, ranges, checksum=checksum)
    assert not any(c.done.query() for _, c in chunks)  # returned without waiting for the compute
    torch.cuda.synchronize()
    ids = torch.tensor(table, device="cuda")
    for r, c in chunks:
        want = reference.gather_blocks(cache, ids[r.block_start:r.block_end], r.layer_start, r.layer_end)
        if checksum:  # computed from the blocks where they lie: the payload is only the chunk's shape
            assert c.checksum_value() == device_checksum(want)
            assert c.payload.is_meta and c.payload.shape == want.shape and c.payload.dtype == want.dtype
        else:
            assert c.payload.is_pinned() and torch.equal(c.payload, want.cpu())


@cuda
@pytest.mark.parametrize("plane,doorbell,corrupt", [("cuda-ipc", True, False), ("cuda-ipc", False, False),
                                                    ("cuda-ipc", True, True), ("grpc", False, False),
                                                    ("shm", True, False)],
                         ids=["parity_doorbell", "parity_stream", "corrupted_copy", "inline_grpc", "shm_doorbell"])
async def test_cuda_ipc_on_gpu_equals_single_process(tmp_path, plane, doorbell, corrupt):
    """Both workers in this process on one GPU (the handle opens as the exported tensor): greedy
    and seeded with layer streaming, then a prefix hit; with the copy's source changed, every
    hand-off is caught and prefilled locally, with the same answers. doorbell: the frames go from
    the prefill worker's ringer thread once the copy stream's checksum is in, and the decode
    worker's doorbell thread copies on the default stream (the default; parity_stream: the chunk
    messages on gRPC). inline_grpc: the K/V of a GPU cache through pinned host memory from the
    copy stream, on gRPC. shm_doorbell: the same pinned copies placed in the shared-memory region
    and rung from the ringer thread (the engine thread never waits for them)."""
    from kvrelay.decode.worker import DecodeWorker
    from kvrelay.prefill.worker import PrefillWorker

    popts = WorkerOptions(stream_min_tokens=0, layer_group_size=2)
    args = {"device": "cuda", "num_kv_blocks": 96}
    p = PrefillWorker(AsyncEngine(EngineArgs(model=str(BUNDLED_MODEL), **args)), popts)
    dopts = WorkerOptions(kv_transport=plane if plane == "cuda-ipc" else None, kv_doorbell=doorbell,
                          kv_shm_dir=str(tmp_path), kv_shm_bytes=64 << 20 if plane == "shm" else 0)
    d = DecodeWorker(AsyncEngine(EngineArgs(model=str(BUNDLED_MODEL), **args)), dopts)
    pp, dp = await p.start(), await d.start()
    if corrupt:
        def changed(msg, dtype):
            cache = cuda_ipc.open_handle(msg, dtype).clone()
            cache.view(torch.int32).reshape(-1)[:: 1 << 12] ^= 1
            return cache

        d.transport.cuda_ipc._opener = changed
    ref = AsyncEngine(EngineArgs(model=str(BUNDLED_MODEL), **args))
    await ref.start()
    client = DecodeClient(f"127.0.0.1:{dp}")
    try:
        runs = [(PROMPT, GREEDY), (PROMPT, SEEDED), (PROMPT[:200] + [9, 9, 9], GREEDY)]  # the last: a prefix hit
        for prompt, params in runs:
            got = await _tokens(client.generate(prompt, params, prefill_addr=f"127.0.0.1:{pp}"))
            assert got == await _tokens(ref.generate(prompt, params))
        failures = d.metrics.failures.labels("ChunkError")._value.get()
        moved = d.metrics.kv_plane_bytes.labels(plane)._value.get()
        if corrupt:
            assert failures == len(runs) == d.metrics.fallbacks.labels("local")._value.get()
        elif plane != "cuda-ipc":
            assert failures == 0 and moved > 0 and d.metrics.fallbacks.labels("local")._value.get() == 0
        else:
            assert failures == 0 and moved > 0 and p.metrics.plane_handoffs.labels("cuda-ipc")._value.get() == 3
        assert p.metrics.doorbells.labels("connected")._value.get() == (len(runs) if doorbell else 0)
        await assert_all_free(p.engine, d.engine)
    finally:
        await client.close()
        await p.stop(0)
        await d.stop(0)
        await ref.shutdown()


@cuda
async def test_cuda_ipc_frames_that_come_before_the_reservation_wait_for_it_on_gpu(tmp_path):  # pragma: no cover
    """The same on the GPU: the ringer thread rings once the copy stream has the checksums, the
    decode worker's doorbell thread waits for the reservation, then copies device to device."""
    from kvrelay.decode.worker import DecodeWorker
    from kvrelay.prefill.worker import PrefillWorker

    args = {"device": "cuda", "num_kv_blocks": 96}
    p = PrefillWorker(AsyncEngine(EngineArgs(model=str(BUNDLED_MODEL), **args)),
                      WorkerOptions(stream_min_tokens=0, layer_group_size=2))
    d = DecodeWorker(AsyncEngine(EngineArgs(model=str(BUNDLED_MODEL), **args)),
                     WorkerOptions(kv_transport="cuda-ipc", kv_shm_dir=str(tmp_path)))
    pp, dp = await p.start(), await d.start()
    ref = AsyncEngine(EngineArgs(model=str(BUNDLED_MODEL), **args))
    await ref.start()
    pair = SimpleNamespace(prefill=p, decode=d, prefill_addr=f"127.0.0.1:{pp}", client=DecodeClient(f"127.0.0.1:{dp}"))
    try:
        for i, params in enumerate((GREEDY, SEEDED)):
            got = await prefill_done_before_reservation(pair, PROMPT, params, f"early{i}")
            assert got == await _tokens(ref.generate(PROMPT, params))
        assert d.metrics.fallbacks.labels("local")._value.get() == 0
        assert p.metrics.doorbells.labels("connected")._value.get() == 2
        await assert_all_free(p.engine, d.engine)
    finally:
        await pair.client.close()
        await p.stop(0)
        await d.stop(0)
        await ref.shutdown()


@cuda
async def test_prefill_killed_mid_cuda_ipc_copy_frees_every_block(spawn):  # pragma: no cover - CUDA only
    """Two worker processes on the GPU, the real IPC handle between them: kill -9 of the prefill
    worker mid-hand-off, and the decode worker frees its reservation and prefills locally with the
    answer a single CUDA process gives."""
    victim = spawn("prefill", *SLOW_PREFILL, "--device", "cuda")
    mport = free_port()
    decode = spawn("decode", "--max-message-bytes", "16KiB", "--metrics-port", str(mport), "--device", "cuda",
                   "--kv-transport", "cuda-ipc")
    ref = AsyncEngine(EngineArgs(model=str(BUNDLED_MODEL), device="cuda", num_kv_blocks=96))
    await ref.start()
    try:
        want = await _tokens(ref.generate(PROMPT, GREEDY))
    finally:
        await ref.shutdown()
    async with DecodeClient(decode.addr) as client:
        task = asyncio.create_task(_tokens(client.generate(PROMPT, GREEDY, "kill-ipc", prefill_addr=victim.addr)))
        await _handoff_started(victim.addr)
        victim.kill()
        assert await asyncio.wait_for(task, 60) == want
    page = scrape(mport)
    assert metric_value(page, "kvrelay:kv_transfer_fallbacks_total", 'kind="local"') == 1
    await assert_worker_free(decode.addr)


def test_a_cache_exported_by_this_process_opens_as_itself(monkeypatch):
    """CUDA refuses to open a process's own IPC handle: a decode worker in the prefill worker's
    process (the GPU device script) gets the exported tensor itself."""
    cache = _cache()
    monkeypatch.setitem(cuda_ipc._EXPORTED, b"z" * 16, cache)
    assert cuda_ipc.open_handle(kv_pb2.CudaIpcCache(nonce=b"z" * 16), torch.float32) is cache
