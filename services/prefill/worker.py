"""The prefill worker: computes a prompt's K/V, samples the first token, and streams both to the
decode worker that asked (PrefillService.Prefill), holding the blocks under a lease meanwhile.

Layer-wise streaming: for prompts of at least `stream_min_tokens`, a hook in the model's forward
pass gathers each finished group of layers during the prompt's final step and queues it for
sending, so early layers travel while later layers still compute. Whatever the hook did not
send (short prompts, or layers after the last group) is gathered from the held blocks once the
first token is out. Both gathers run on the engine thread, which owns the cache; the blocks are
never written (they may be shared with the prefix cache), only read while held.

Doorbell (same node, kvrelay.kvtransfer.doorbell): when the decode worker offers a shared-memory
region (or the CUDA IPC plane) and a doorbell socket this worker can reach, the engine thread
itself places each chunk in the region and rings, in the layer hook and right after the step that
samples the first token (AsyncEngine.after_step); chunks still on a GPU's copy stream are rung by
a ringer thread once they are ready. The event loop then only waits for the ack, an abort, or
the end.

This module handles the requests (RPCs, compute, leases, release); the stream sender is in
sender.py (HandoffSender), the layer hook, gathers and doorbell rings in engine_side.py
(EngineThreadSide), and one hand-off's state in handoff.py.
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
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.errors import EngineDeadError, InvalidRequestError
from kvrelay.kvtransfer.chunk_wire import PREFILL_SERVICE
from kvrelay.kvtransfer.convert import params_from_proto
from kvrelay.kvtransfer.cuda_ipc import CudaIpcExport
from kvrelay.kvtransfer.doorbell import DoorbellClient
from kvrelay.kvtransfer.errors import LayoutMismatchError
from kvrelay.kvtransfer.layout import KVLayout, check_layout, plan_chunks
from kvrelay.kvtransfer.leases import Lease, LeaseTable
from kvrelay.kvtransfer.mooncake import MooncakeWriter
from kvrelay.kvtransfer.planes import open_remote
from kvrelay.kvtransfer.prompt_logprobs_wire import PREFILL_HOP, check_prompt_logprobs_fit
from kvrelay.kvtransfer.shm import SharedKVCache, ShmOpener
from kvrelay.kvtransfer.status import abort_with
from kvrelay.kvtransfer.worker_base import WorkerBase, WorkerOptions
from kvrelay.prefill.engine_side import EngineThreadSide
from kvrelay.prefill.handoff import Handoff
from kvrelay.prefill.sender import HandoffSender
from kvrelay.v1 import kv_pb2, prefill_pb2, prefill_pb2_grpc

log = logging.getLogger(__name__)


class PrefillWorker(HandoffSender, EngineThreadSide, WorkerBase, prefill_pb2_grpc.PrefillServiceServicer):
    role = "prefill"

    def __init__(self, engine: AsyncEngine, options: WorkerOptions | None = None):
        super().__init__(engine, options)
        self.llm = engine.engine
        self.leases = LeaseTable()
        self._handoffs: dict[str, Handoff] = {}  # lease id -> hand-off
        self._streaming: dict[str, Handoff] = {}  # lease id -> hand-off the layer hook serves
        self._lock = threading.Lock()  # guards _streaming (loop thread writes, engine thread reads)
        self._final: list[Handoff] = []  # engine thread: hand-offs whose prompt completes this step
        self.group = self.options.layer_group_size or max(1, -(-self.layout.num_layers // 4))
        self.llm.model.layer_hook = self._on_layer
        self._layout_msg = self.layout.to_proto()
        self._reaper: asyncio.Task | None = None
        self.shm = ShmOpener()
        self.doorbells = DoorbellClient(self._on_doorbell_ack)
        self._by_ticket: dict[bytes, Handoff] = {}  # doorbell hand-offs by ticket (guarded by _lock)
        self._ringing: dict[str, Handoff] = {}  # lease id -> doorbell hand-off still computing (_lock)
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
        if self._ringer is not None:
            self._ringer.shutdown(wait=False)
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
        if params.prompt_logprobs is not None:  # they go in one message: refuse before computing
            try:
                check_prompt_logprobs_fit(len(ids), params.prompt_logprobs, max_msg, PREFILL_HOP)
            except InvalidRequestError as e:
                await abort_with(context, e)
        num_blocks = -(-len(ids) // self.layout.block_size)
        if start.num_cached_blocks > len(ids) // self.layout.block_size:
            await abort_with(context, InvalidRequestError(
                f"num_cached_blocks {start.num_cached_blocks}: the prompt has only {len(ids) // self.layout.block_size} "
                f"full blocks", "num_cached_blocks"))
        lease = Lease(lease_id=uuid.uuid4().hex, request_id=start.request_id, num_tokens=len(ids),
                      task=asyncio.current_task())
        h = Handoff(lease, asyncio.Queue(), asyncio.get_running_loop(), num_blocks=num_blocks,
                    max_message_bytes=max_msg, first_block=start.num_cached_blocks,
                    client_request_id=dict(context.invocation_metadata() or ()).get("x-request-id", ""))
        # Doorbell frames hold headers only and are sent without blocking: PrefillDone with prompt
        # logprobs (up to a message's size) goes on the stream instead.
        ring = params.prompt_logprobs is None
        if start.HasField("cuda_ipc"):
            h.cuda_ipc = self.cuda_ipc.answer(start.cuda_ipc)
            if h.cuda_ipc is not None and start.cuda_ipc.doorbell and ring:
                self._connect_doorbell(h, start.cuda_ipc.doorbell, start.cuda_ipc.ticket)
        if start.HasField("shm") and h.cuda_ipc is None:
            h.shm = self._open_shm(start.shm, h.num_blocks - h.first_block)
            if h.shm is not None and start.shm.doorbell and ring and self._connect_doorbell(h, start.shm.doorbell,
                                                                                            start.shm.ticket):
                h.direct = start.shm.direct and self.shared_cache is not None
                if h.direct:
                    self.metrics.direct.inc()
        if start.HasField("remote"):
            h.remote = open_remote(self.mooncake, start.remote, self.layout.bytes_for_blocks(h.num_blocks - h.first_block),
                                   self.metrics)
        self.leases.add(lease)
        self._handoffs[lease.lease_id] = h
        reader = asyncio.create_task(self._read_decode_side(it, h))
        compute: asyncio.Task | None = None
        reason = "stream_broken"
        try:
            if len(ids) >= self.options.stream_min_tokens:
                with self._lock:
                    self._streaming[lease.lease_id] = h
            # The prefill starts while the header goes out (chunks queue behind it; doorbell frames
            # may overtake it, which the decode side expects).
            compute = asyncio.create_task(self._compute(h, ids, params, start.priority, start.cache_salt or None))
            await context.write(kv_pb2.PrefillServerMessage(header=kv_pb2.HandoffHeader(
                lease_id=lease.lease_id, layout=self.layout.to_proto(), num_tokens=len(ids),
                num_blocks=h.num_blocks, lease_seconds=self.options.lease_seconds, shm=h.shm is not None,
                doorbell=h.doorbell is not None, remote=h.remote is not None, cuda_ipc=h.cuda_ipc)))
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

    def _connect_doorbell(self, h: Handoff, path: str, ticket: bytes) -> bool:
        """Whether the offered doorbell connects: then the engine thread rings h's chunks and done."""
        h.doorbell = self.doorbells.connect(path)
        self.metrics.doorbells.labels("connected" if h.doorbell is not None else "unreachable").inc()
        if h.doorbell is None:
            return False
        h.ticket = ticket
        with self._lock:
            self._by_ticket[h.ticket] = h
            self._ringing[h.lease.lease_id] = h
        return True

    def _open_shm(self, offer: kv_pb2.ShmRegion, num_blocks: int) -> np.ndarray | None:
        """The offered region if this worker sees the decode worker's arena file and the region
        holds the num_blocks to send; else None, and the K/V goes inline."""
        if offer.size < self.layout.bytes_for_blocks(num_blocks):
            return None
        region = self.shm.open(offer.path, offer.nonce, offer.offset, offer.size)
        self.metrics.shm_offers.labels("accepted" if region is not None else "unreachable").inc()
        return region

    # ---- hand-off steps -----------------------------------------------------------------------

    async def _compute(self, h: Handoff, ids: list[int], params, priority: int, cache_salt: str | None = None) -> None:
        lease = h.lease
        t0 = h.started_at = time.monotonic()
        try:
            out = None
            async for out in self.engine.generate(ids, params, lease.lease_id, priority, hold_blocks=True,
                                                  cache_salt=cache_salt):
                if out.prompt_logprobs is not None:
                    h.prompt_logprobs = out.prompt_logprobs
            if out is None or not out.new_token_ids:
                raise EngineDeadError(f"the prefill ended without a token ({out and out.finish_reason})")
            lease.compute_done = True
            lease.renew(self.options.lease_seconds)
            self.metrics.ttft.observe(time.monotonic() - t0)  # queue + compute on this worker
            with self._lock:
                self._streaming.pop(lease.lease_id, None)
            if h.doorbell is not None:  # the step's after_step hook rang with the rest and done
                if h.ring_job is not None:  # rung from the ringer thread once the GPU had the chunks
                    await asyncio.wrap_future(h.ring_job)
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

    async def _read_decode_side(self, it, h: Handoff) -> None:
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

    def _interrupt(self, h: Handoff, event: tuple) -> None:
        """Ask the hand-off to end with an explicit message to the decode side; if it is stuck
        writing to a decode worker that stopped reading, cancel it after a second."""
        h.interrupt = h.interrupt or event
        h.events.put_nowait(event)
        task = h.lease.task
        if task is not None:
            h.loop.call_later(1.0, lambda: task.done() or task.cancel())

    async def _release(self, h: Handoff, reason: str) -> None:
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
