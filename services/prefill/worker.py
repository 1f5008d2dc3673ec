"""The prefill worker: computes a prompt's K/V, samples the first token, and streams both to the
decode worker that asked (PrefillService.Prefill), holding the blocks under a lease meanwhile.

Layer-wise streaming: for prompts of at least `stream_min_tokens`, a hook in the model's forward
pass gathers each finished group of layers during the prompt's final step and queues it for
sending, so early layers travel while later layers still compute. Whatever the hook did not
send (short prompts, or layers after the last group) is gathered from the held blocks once the
first token is out. Both gathers run on the engine thread, which owns the cache; the blocks are
never written (they may be shared with the prefix cache), only read while held.

Doorbell (same node, kvrelay.kvtransfer.doorbell): when the decode worker offers a shared-memory
region and a doorbell socket this worker can reach, the engine thread itself places each chunk
in the region and rings, in the layer hook and right after the step that samples the first
token (AsyncEngine.after_step); the event loop then only waits for the ack, an abort, or the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
import uuid

import grpc
import numpy as np
import torch
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.errors import EngineDeadError, InvalidRequestError
from kvrelay.engine.sequence import Status
from kvrelay.kvtransfer.chunk_wire import (
    PREFILL_SERVICE,
    Payload,
    encode_chunk_message,
    payload_arrays,
    payload_pieces,
    payload_size,
    pieces_checksum,
    place_chunk,
)
from kvrelay.kvtransfer.convert import logprob_to_proto, params_from_proto
from kvrelay.kvtransfer.cuda_ipc import CudaIpcExport
from kvrelay.kvtransfer.doorbell import DoorbellClient, DoorbellConn
from kvrelay.kvtransfer.errors import LayoutMismatchError
from kvrelay.kvtransfer.layout import ChunkRange, KVLayout, check_layout, chunk_header, plan_chunks
from kvrelay.kvtransfer.leases import Lease, LeaseTable
from kvrelay.kvtransfer.mooncake import MooncakeWriter, RemoteTarget
from kvrelay.kvtransfer.planes import open_remote
from kvrelay.kvtransfer.shm import SharedKVCache, ShmOpener
from kvrelay.kvtransfer.status import abort_with
from kvrelay.kvtransfer.worker_base import WorkerBase, WorkerOptions
from kvrelay.v1 import kv_pb2, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _Handoff:
    lease: Lease
    # ("chunk", range, payload) | ("done", out) | ("error", exc) | ("ack"[, read_at, written_at])
    # | abort/gone/...
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    num_blocks: int
    max_message_bytes: int
    first_block: int = 0  # the decode worker holds blocks before this one (its prefix cache)
    sent_layers: int = 0  # layers already gathered (engine thread only)
    bytes_sent: int = 0
    bytes_before_compute_done: int = 0
    done_sent: bool = False
    # When K/V first started towards the decode side (monotonic): the first layer-streamed chunk
    # taken for sending, or else the end of the prefill, before the remaining blocks are gathered.
    send_started_at: float | None = None
    shm: np.ndarray | None = None  # the decode worker's shared-memory region, when this worker can open it
    shm_next: int = 0  # where the next chunk's bytes go in it
    doorbell: DoorbellConn | None = None  # set: chunks and done go on the decode worker's doorbell
    ticket: bytes = b""  # the hand-off's name on the doorbell
    doorbell_error: Exception | None = None  # a ring failed (engine thread): the hand-off fails
    client_request_id: str = ""  # the client's X-Request-Id, from the decode worker's call metadata
    direct: bool = False  # the decode worker copies the blocks out of this worker's shared cache
    remote: RemoteTarget | None = None  # set: chunks' bytes go into the decode worker's transfer-engine region
    cuda_ipc: kv_pb2.CudaIpcCache | None = None  # set: the decode worker copies held blocks over CUDA IPC
    block_table: list[int] = dataclasses.field(default_factory=list)  # of the last gather (engine thread)
    started_at: float = 0.0  # when the prefill was submitted (monotonic)
    interrupt: tuple | None = None  # the first _interrupt's event, acted on before queued chunks


class _PipelinedWriter:
    """One chunk in flight while the caller encodes the next (gRPC allows one outstanding
    write per stream), so checksum and copies overlap the socket work."""

    def __init__(self, context):
        self.context = context
        self._task: asyncio.Task | None = None

    async def write(self, msg, on_sent) -> None:
        await self.flush()
        self._task = asyncio.create_task(self._write(msg, on_sent))

    async def _write(self, msg, on_sent) -> None:
        await self.context.write(msg)
        on_sent()

    async def flush(self) -> None:
        if self._task is not None:
            task, self._task = self._task, None
            await task

    def cancel(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()


class PrefillWorker(WorkerBase, prefill_pb2_grpc.PrefillServiceServicer):
    role = "prefill"

    def __init__(self, engine: AsyncEngine, options: WorkerOptions | None = None):
        super().__init__(engine, options)
        self.llm = engine.engine
        self.leases = LeaseTable()
        self._handoffs: dict[str, _Handoff] = {}  # lease id -> hand-off
        self._streaming: dict[str, _Handoff] = {}  # lease id -> hand-off the layer hook serves
        self._lock = threading.Lock()  # guards _streaming (loop thread writes, engine thread reads)
        self._final: list[_Handoff] = []  # engine thread: hand-offs whose prompt completes this step
        self.group = self.options.layer_group_size or max(1, -(-self.layout.num_layers // 4))
        self.llm.model.layer_hook = self._on_layer
        self._layout_msg = self.layout.to_proto()
        self._reaper: asyncio.Task | None = None
        self.shm = ShmOpener()
        self.doorbells = DoorbellClient(self._on_doorbell_ack)
        self._by_ticket: dict[bytes, _Handoff] = {}  # doorbell hand-offs by ticket (guarded by _lock)
        self._ringing: dict[str, _Handoff] = {}  # lease id -> doorbell hand-off still computing (_lock)
        engine.after_step = self._after_step
        storage = self.llm.kv_cache_storage
        self.shared_cache = storage if isinstance(storage, SharedKVCache) else None
        self._source_msg = self.shared_cache.offer() if self.shared_cache is not None else None
        self.mooncake = MooncakeWriter(self.options.kv_mooncake_host)  # its engine starts at the first offer
        self.cuda_ipc = CudaIpcExport(self.llm, self.options.node_name, self.metrics)

    def add_services(self, server: grpc.aio.Server) -> None:
        add_prefill_service(self, server)

    def active_handoffs(self) -> int:
        return len(self.leases)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        port = await super().start(host, port)
        self._reaper = asyncio.create_task(self._reap())
        return port

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for h in list(self._handoffs.values()):  # tell each decode worker before the streams close
            self._interrupt(h, ("shutdown", "the prefill worker is shutting down"))
        if self._handoffs:
            await asyncio.sleep(0.05)
        await super().stop(grace_s)
        self.doorbells.close()
        if self.shared_cache is not None:
            self.shared_cache.close()  # unlinks the file; the engine's mapping stays valid

    # ---- RPCs ---------------------------------------------------------------------------------

    async def Abort(self, request, context):
        leases = self.leases.by_request(request.request_id)
        for lease in leases:
            self.metrics.aborts.labels("client").inc()
            self._interrupt(self._handoffs[lease.lease_id], ("client_abort", request.reason or "aborted by client"))
        return prefill_pb2.AbortReply(found=bool(leases))

    async def Prefill(self, request_iterator, context):
        it = request_iterator.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            return
        if first.WhichOneof("kind") != "start":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a hand-off must begin with PrefillStart")
        start = first.start
        try:
            check_layout(self.layout, KVLayout.from_proto(start.expected_layout), "decode worker's cache vs this "
                                                                                    "prefill worker's")
        except LayoutMismatchError as e:
            self.metrics.failures.labels("layout_mismatch").inc()
            await abort_with(context, e)
        ids = list(start.prompt_token_ids)
        params = dataclasses.replace(params_from_proto(start.params), n=1, max_tokens=1)
        max_msg = min(self.options.max_message_bytes, start.max_message_bytes or self.options.max_message_bytes)
        try:
            plan_chunks(self.layout, 0, 1, 1, max_msg)
        except ValueError as e:
            await abort_with(context, InvalidRequestError(f"max_message_bytes: {e}", "max_message_bytes"))
        num_blocks = -(-len(ids) // self.layout.block_size)
        if start.num_cached_blocks > len(ids) // self.layout.block_size:
            await abort_with(context, InvalidRequestError(
                f"num_cached_blocks {start.num_cached_blocks}: the prompt has only {len(ids) // self.layout.block_size} "
                f"full blocks", "num_cached_blocks"))
        lease = Lease(lease_id=uuid.uuid4().hex, request_id=start.request_id, num_tokens=len(ids),
                      task=asyncio.current_task())
        h = _Handoff(lease, asyncio.Queue(), asyncio.get_running_loop(), num_blocks=num_blocks,
                     max_message_bytes=max_msg, first_block=start.num_cached_blocks,
                     client_request_id=dict(context.invocation_metadata() or ()).get("x-request-id", ""))
        if start.HasField("shm"):
            h.shm = self._open_shm(start.shm, h.num_blocks - h.first_block)
            if h.shm is not None and start.shm.doorbell:
                h.doorbell = self.doorbells.connect(start.shm.doorbell)
                self.metrics.doorbells.labels("connected" if h.doorbell is not None else "unreachable").inc()
                if h.doorbell is not None:
                    h.ticket = start.shm.ticket
                    h.direct = start.shm.direct and self.shared_cache is not None
                    if h.direct:
                        self.metrics.direct.inc()
                    with self._lock:
                        self._by_ticket[h.ticket] = h
                        self._ringing[lease.lease_id] = h
        if start.HasField("remote"):
            h.remote = open_remote(self.mooncake, start.remote, self.layout.bytes_for_blocks(h.num_blocks - h.first_block),
                                   self.metrics)
        if start.HasField("cuda_ipc"):
            h.cuda_ipc = self.cuda_ipc.answer(start.cuda_ipc)
        self.leases.add(lease)
        self._handoffs[lease.lease_id] = h
        reader = asyncio.create_task(self._read_decode_side(it, h))
        compute: asyncio.Task | None = None
        reason = "stream_broken"
        try:
            await context.write(kv_pb2.PrefillServerMessage(header=kv_pb2.HandoffHeader(
                lease_id=lease.lease_id, layout=self.layout.to_proto(), num_tokens=len(ids),
                num_blocks=h.num_blocks, lease_seconds=self.options.lease_seconds, shm=h.shm is not None,
                doorbell=h.doorbell is not None, remote=h.remote is not None, cuda_ipc=h.cuda_ipc)))
            if len(ids) >= self.options.stream_min_tokens:
                with self._lock:
                    self._streaming[lease.lease_id] = h
            compute = asyncio.create_task(self._compute(h, ids, params, start.priority, start.cache_salt or None))
            reason = await self._send_loop(h, context)
        except asyncio.CancelledError:
            reason = lease.release_reason or "stream_broken"
            raise
        finally:
            reader.cancel()
            if compute is not None and not compute.done():
                compute.cancel()
                await asyncio.gather(compute, return_exceptions=True)
            await asyncio.shield(self._release(h, lease.release_reason or reason))

    def _open_shm(self, offer: kv_pb2.ShmRegion, num_blocks: int) -> np.ndarray | None:
        """The offered region if this worker sees the decode worker's arena file and the region
        holds the num_blocks to send; else None, and the K/V goes inline."""
        if offer.size < self.layout.bytes_for_blocks(num_blocks):
            return None
        region = self.shm.open(offer.path, offer.nonce, offer.offset, offer.size)
        self.metrics.shm_offers.labels("accepted" if region is not None else "unreachable").inc()
        return region

    # ---- hand-off steps -----------------------------------------------------------------------

    async def _send_loop(self, h: _Handoff, context) -> str:
        """Forward chunks and the first token to the decode worker; returns why the hand-off ended."""
        out = _PipelinedWriter(context)
        try:
            while True:
                ev = await h.events.get()
                if ev[0] == "chunk":
                    # An abort (either side), lease expiry or shutdown is queued behind the chunks:
                    # act on it now instead of sending them all first.
                    if h.lease.release_reason == "decode_abort":
                        return "decode_abort"
                    if h.interrupt is not None:
                        await out.flush()
                        return await self._handle_event(h, h.interrupt, context)
                    _, r, t = ev
                    if h.send_started_at is None:
                        h.send_started_at = time.monotonic()
                    header = chunk_header(self._layout_msg, r, h.lease.num_tokens)
                    size = payload_size(t)
                    if h.cuda_ipc is not None:  # the decode worker copies the held blocks itself
                        msg = self.cuda_ipc.chunk(header, t, h.block_table[r.block_start:r.block_end])
                    elif h.remote is not None:
                        try:  # the bytes land in the decode worker's region before the header goes
                            msg = await asyncio.to_thread(h.remote.place, header, t)
                        except (ConnectionError, ValueError) as e:
                            await out.flush()
                            why = f"remote write failed: {e}"
                            await context.write(kv_pb2.PrefillServerMessage(aborted=kv_pb2.PrefillAborted(reason=why)))
                            return "remote_write_failed"
                    elif h.shm is None:
                        msg = encode_chunk_message(header, t)
                    else:
                        msg = place_chunk(header, t, h.shm, h.shm_next)
                        h.shm_next += size
                    await out.write(msg, lambda size=size: self._chunk_sent(h, size))
                    if h.shm is not None or h.remote is not None:
                        # The bytes are already in place: let the small message go out now, not
                        # after the next chunk's copy (traced: it went ~1.1 ms later at 1k tokens).
                        await asyncio.sleep(0)
                    if self.options.debug_chunk_delay_s:
                        await out.flush()
                        await asyncio.sleep(self.options.debug_chunk_delay_s)
                    continue
                await out.flush()  # every chunk is out before any other message
                reason = await self._handle_event(h, ev, context)
                if reason is not None:
                    return reason
        finally:
            out.cancel()

    def _chunk_sent(self, h: _Handoff, size: int) -> None:
        h.bytes_sent += size
        if not h.lease.compute_done:
            h.bytes_before_compute_done += size
        h.lease.renew(self.options.lease_seconds)

    async def _handle_event(self, h: _Handoff, ev: tuple, context) -> str | None:
        """A non-chunk event; returns why the hand-off ends, or None to continue."""
        lease, kind = h.lease, ev[0]
        if kind == "done":
            await context.write(kv_pb2.PrefillServerMessage(done=self._done_message(h, ev[1])))
            h.done_sent = True
            lease.renew(self.options.lease_seconds)
            return None
        if kind == "ack":
            if h.done_sent:
                if h.send_started_at is not None:
                    # One clock, and nothing left out: gather, encode, wire, verify and cache write
                    # of every chunk, the first one included (to a doorbell ack's stamp of the
                    # last write, or a stream ack's arrival).
                    self.metrics.kv_send_seconds.observe(self._transfer_end(h, ev) - h.send_started_at)
                    self.metrics.kv_send_bytes.inc(h.bytes_sent)
                return "ack"
            why = "ack before the hand-off completed"
            await context.write(kv_pb2.PrefillServerMessage(aborted=kv_pb2.PrefillAborted(reason=why)))
            return "protocol_error"
        if kind == "abort":
            return "decode_abort"
        if kind == "gone":
            return "stream_broken"
        if kind in ("client_abort", "lease_expired", "shutdown"):
            lease.release_reason = kind
            await context.write(kv_pb2.PrefillServerMessage(aborted=kv_pb2.PrefillAborted(reason=ev[1])))
            return kind
        # kind == "error": the prefill itself failed
        exc = ev[1]
        if isinstance(exc, InvalidRequestError):
            await abort_with(context, exc)
        why = f"prefill failed: {exc}"
        await context.write(kv_pb2.PrefillServerMessage(aborted=kv_pb2.PrefillAborted(reason=why)))
        return "error"

    def _done_message(self, h: _Handoff, out) -> kv_pb2.PrefillDone:
        done = kv_pb2.PrefillDone(
            first_token_id=out.new_token_ids[0], num_cached_tokens=out.num_cached_tokens,
            total_bytes=h.bytes_sent, bytes_before_compute_done=h.bytes_before_compute_done,
            prefill_seconds=time.monotonic() - h.started_at, has_logprob=bool(out.logprobs))
        if out.logprobs:
            done.first_logprob.CopyFrom(logprob_to_proto(out.logprobs[0]))
        return done

    async def _compute(self, h: _Handoff, ids: list[int], params, priority: int, cache_salt: str | None = None) -> None:
        lease = h.lease
        t0 = h.started_at = time.monotonic()
        try:
            out = None
            async for out in self.engine.generate(ids, params, lease.lease_id, priority, hold_blocks=True,
                                                  cache_salt=cache_salt):
                pass
            if out is None or not out.new_token_ids:
                raise EngineDeadError(f"the prefill ended without a token ({out and out.finish_reason})")
            lease.compute_done = True
            lease.renew(self.options.lease_seconds)
            self.metrics.ttft.observe(time.monotonic() - t0)  # queue + compute on this worker
            with self._lock:
                self._streaming.pop(lease.lease_id, None)
            if h.doorbell is not None:  # the step's after_step hook rang with the rest and done
                if h.doorbell_error is not None or not h.done_sent:
                    raise h.doorbell_error or EngineDeadError("the prefill's last step rang no doorbell")
                return
            if h.send_started_at is None:
                h.send_started_at = time.monotonic()
            for r, t in await self.engine.call_in_engine_thread(lambda llm: self._gather_rest(h)):
                h.events.put_nowait(("chunk", r, t))
            h.events.put_nowait(("done", out))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure is reported to the decode side
            log.warning("prefill of %s failed: %s", lease.request_id, e)
            h.events.put_nowait(("error", e))

    async def _read_decode_side(self, it, h: _Handoff) -> None:
        with contextlib.suppress(Exception):  # a broken stream is reported as "gone"
            async for msg in it:
                kind = msg.WhichOneof("kind")
                if kind == "ack":
                    h.events.put_nowait(("ack",))
                elif kind == "abort":
                    self.metrics.aborts.labels("decode").inc()
                    h.lease.release_reason = h.lease.release_reason or "decode_abort"
                    h.events.put_nowait(("abort", msg.abort.reason))
                    return
        h.events.put_nowait(("gone",))

    def _interrupt(self, h: _Handoff, event: tuple) -> None:
        """Ask the hand-off to end with an explicit message to the decode side; if it is stuck
        writing to a decode worker that stopped reading, cancel it after a second."""
        h.interrupt = h.interrupt or event
        h.events.put_nowait(event)
        task = h.lease.task
        if task is not None:
            h.loop.call_later(1.0, lambda: task.done() or task.cancel())

    async def _release(self, h: _Handoff, reason: str) -> None:
        lease = h.lease
        if lease.released:
            return
        lease.released = True
        lease.release_reason = reason
        with self._lock:
            self._streaming.pop(lease.lease_id, None)
            self._ringing.pop(lease.lease_id, None)
            self._by_ticket.pop(h.ticket, None)
        try:
            await self.engine.call_in_engine_thread(lambda llm: llm.release(lease.lease_id))
        finally:
            self.leases.remove(lease)
            self._handoffs.pop(lease.lease_id, None)
            self.metrics.kv_handoffs.labels(reason).inc()
            log.info("hand-off of %s ended: %s (x-request-id %s, %d prompt tokens, %d bytes)", lease.request_id,
                     reason, h.client_request_id or "-", lease.num_tokens, h.bytes_sent)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            for lease in self.leases.expired():
                h = self._handoffs.get(lease.lease_id)
                if h is None or lease.release_reason == "lease_expired":
                    continue
                log.warning("lease of %s expired after %.1f s without an ack: freeing its blocks",
                            lease.request_id, self.options.lease_seconds)
                lease.release_reason = "lease_expired"
                self.metrics.lease_expiries.inc()
                reason = f"lease expired ({self.options.lease_seconds:.1f} s without progress or ack)"
                self._interrupt(h, ("lease_expired", reason))

    # ---- engine thread ----------------------------------------------------------------------

    def _gather(self, h: _Handoff, block_table: list[int], lo: int, hi: int) -> list[tuple[ChunkRange, Payload]]:
        ranges = plan_chunks(self.layout, lo, hi, h.num_blocks, h.max_message_bytes, h.first_block)
        if self.llm.executor is not None:  # tensor/pipeline parallel: every rank sends its heads and layers
            out = [(r, self.llm.executor.gather_blocks(block_table[r.block_start:r.block_end], r.layer_start,
                                                      r.layer_end)) for r in ranges]
        elif self.llm.device.type == "cpu":
            # Views of the held blocks: encoding joins them straight into the message, so the
            # sender's CPU (the hand-off's bottleneck on one core) skips a gather copy and the
            # engine thread no longer spends ~0.5 ms per 4 MiB chunk gathering.
            cache = self.llm.kv_cache
            out = [(r, payload_pieces(cache, block_table[r.block_start:r.block_end], r.layer_start, r.layer_end))
                   for r in ranges]
        else:
            ids = torch.tensor(block_table, dtype=torch.long, device=self.llm.device)
            out = [(r, self.llm.ops.gather_blocks(self.llm.kv_cache, ids[r.block_start:r.block_end], r.layer_start,
                                                  r.layer_end)) for r in ranges]
            if h.cuda_ipc is None:  # CUDA IPC: the checksum runs on the GPU, the bytes never leave it
                out = [(r, t.cpu()) for r, t in out]
        h.sent_layers = hi
        h.block_table = block_table
        return out

    def _gather_rest(self, h: _Handoff) -> list[tuple[ChunkRange, Payload]]:
        """After the first token: the layers the hook did not send, from the held blocks."""
        if h.lease.released or h.sent_layers >= self.layout.num_layers:
            return []
        return self._gather(h, self.llm.held_blocks(h.lease.lease_id), h.sent_layers, self.layout.num_layers)

    def _on_layer(self, layer_idx: int, batch) -> None:
        """Model hook: layer layer_idx just wrote its K/V for this step. Never raises: a failure
        here would stop the engine; the layers not streamed are sent from the held blocks instead."""
        try:
            self._stream_layers(layer_idx, batch)
        except Exception:
            log.exception("layer-wise streaming failed; the rest goes after the prefill")
            with self._lock:
                for h in self._final:
                    self._streaming.pop(h.lease.lease_id, None)
            self._final = []

    def _stream_layers(self, layer_idx: int, batch) -> None:
        if layer_idx == 0:
            with self._lock:
                candidates = list(self._streaming.values())
            self._final = [h for h in candidates if self._completes_prompt(h, batch)]
        if not self._final:
            return
        hi = layer_idx + 1
        for h in self._final:
            if h.lease.released or hi - h.sent_layers < self.group and hi < self.layout.num_layers:
                continue
            (seq,) = self.llm.requests[h.lease.lease_id]
            chunks = self._gather(h, seq.block_table, h.sent_layers, hi)
            if h.doorbell is not None:
                self._ring(h, chunks, during_compute=True)
                continue
            for r, t in chunks:
                h.loop.call_soon_threadsafe(h.events.put_nowait, ("chunk", r, t))

    def _after_step(self, outputs) -> None:
        """AsyncEngine.after_step: ring with the rest of the K/V and the first token of each
        doorbell hand-off whose prefill this step finished, before the output reaches the loop."""
        with self._lock:
            if not self._ringing:
                return
            finished = [(self._ringing.pop(o.request_id), o) for o in outputs
                        if o.finished and o.request_id in self._ringing]
        for h, out in finished:
            if not out.new_token_ids:
                continue  # aborted or failed: _compute reports it on the stream
            try:
                chunks = self._gather_rest(h)
            except Exception as e:  # noqa: BLE001 - must not stop the engine; the hand-off fails
                h.doorbell_error = e
                continue
            # Chunks as planned (up to max_message_bytes each): smaller frames, e.g. one per layer
            # group, measured no faster at 128 tokens (the copies are bound by cold caches).
            self._ring(h, chunks, out)

    def _ring(self, h: _Handoff, chunks: list[tuple[ChunkRange, Payload]], out=None,
              during_compute: bool = False) -> None:
        """Engine thread: for each chunk, place it in the region and send its header in a frame
        on the doorbell, so the decode worker copies one chunk while this thread places the
        next; PrefillDone (when out, the prefill's last output, is given) goes in the last frame.
        Never raises: a failure is kept in h.doorbell_error, and _compute reports it on the stream."""
        frames = [[c] for c in chunks] or [[]]
        for i, frame_chunks in enumerate(frames):
            last = i == len(frames) - 1
            if h.doorbell_error is not None or h.lease.released:
                return
            try:
                self._ring_one(h, frame_chunks, out if last else None, during_compute)
            except Exception as e:  # noqa: BLE001 - see the docstring
                log.warning("doorbell hand-off of %s failed: %s", h.lease.request_id, e)
                h.doorbell_error = e
                return
            if self.options.debug_chunk_delay_s and not (last and out is not None):
                time.sleep(self.options.debug_chunk_delay_s)  # fault injection: holds the engine thread

    def _ring_one(self, h: _Handoff, chunks: list[tuple[ChunkRange, Payload]], out, during_compute: bool) -> None:
        if h.send_started_at is None:
            h.send_started_at = time.monotonic()
        frame = kv_pb2.DoorbellFrame(ticket=h.ticket)
        for r, t in chunks:
            if h.direct:  # the decode worker copies these blocks out of our cache
                chunk = chunk_header(self._layout_msg, r, h.lease.num_tokens)
                chunk.source_block_ids.extend(h.block_table[r.block_start:r.block_end])
                size = payload_size(t)
            else:
                chunk = place_chunk(chunk_header(self._layout_msg, r, h.lease.num_tokens), t, h.shm,
                                    h.shm_next).chunk
                size = chunk.shm_size
                h.shm_next += size
            h.bytes_sent += size
            if during_compute:
                h.bytes_before_compute_done += size
            frame.chunks.append(chunk)
        if h.direct and chunks:
            # Ring with the headers first, then hash while the decode worker copies (the two cores
            # overlap: 1.3-1.5x kv_shm_floor.py's direct path), and send the hashes after.
            frame.source.CopyFrom(self._source_msg)
            self._send(h, frame)
            frame = kv_pb2.DoorbellFrame(ticket=h.ticket, checksums=[pieces_checksum(payload_arrays(t))
                                                                     for _, t in chunks])
        if out is not None:
            frame.done.CopyFrom(self._done_message(h, out))
            # Before the ring: the decode worker's ack can reach the event loop before this
            # thread runs its next line, and an ack before done is a protocol error.
            h.done_sent = True
        self._send(h, frame)

    def _send(self, h: _Handoff, frame: kv_pb2.DoorbellFrame) -> None:
        if not h.doorbell.ring(frame):
            raise ConnectionError(f"the doorbell socket {h.doorbell.path} broke: the decode worker left or stopped "
                                  f"reading")
        h.lease.renew(self.options.lease_seconds)

    def _transfer_end(self, h: _Handoff, ev: tuple) -> float:
        """When the decode worker had every chunk written: a doorbell ack's stamp (one node, one
        monotonic clock), else when the ack was read here. Its way back is counted apart."""
        read_at = ev[1] if len(ev) > 1 else time.monotonic()
        written_at = ev[2] if len(ev) > 2 else None
        if written_at is None or not h.send_started_at <= written_at <= read_at:
            return read_at  # a stream ack, or clocks that differ (another time namespace)
        self.metrics.doorbell_ack_delay.observe(read_at - written_at)
        return written_at

    def _on_doorbell_ack(self, ticket: bytes, read_at: float, written_at: float | None) -> None:
        """A doorbell connection's reader thread."""
        with self._lock:
            h = self._by_ticket.get(ticket)
        if h is not None:
            h.loop.call_soon_threadsafe(h.events.put_nowait, ("ack", read_at, written_at))

    def _completes_prompt(self, h: _Handoff, batch) -> bool:
        """Whether this step computes the last prompt tokens of h's sequence."""
        seqs = self.llm.requests.get(h.lease.lease_id)
        if not seqs:
            return False
        seq = seqs[0]
        if seq.status is not Status.RUNNING or seq.num_computed >= seq.prompt_len:
            return False
        n = len(seq.block_table)
        for tables, lens in ((batch.prefill_block_tables, batch.prefill_seq_lens),
                             (batch.decode_block_tables, batch.decode_seq_lens)):
            for row, length in enumerate(lens.tolist()):
                if length == seq.prompt_len and tables[row, :n].tolist() == seq.block_table:
                    return True
        return False


def _serialize_server_message(msg: kv_pb2.PrefillServerMessage | bytes) -> bytes:
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def add_prefill_service(servicer, server: grpc.aio.Server) -> None:
    """What the generated add_PrefillServiceServicer_to_server does, except that Prefill may
    also write KV chunks already serialised by chunk_wire (bytes), which pass through as they are."""
    handlers = {
        "Prefill": grpc.stream_stream_rpc_method_handler(
            servicer.Prefill, request_deserializer=kv_pb2.PrefillClientMessage.FromString,
            response_serializer=_serialize_server_message),
        "Abort": grpc.unary_unary_rpc_method_handler(
            servicer.Abort, request_deserializer=prefill_pb2.AbortRequest.FromString,
            response_serializer=prefill_pb2.AbortReply.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(PREFILL_SERVICE, handlers),))
    server.add_registered_method_handlers(PREFILL_SERVICE, handlers)
