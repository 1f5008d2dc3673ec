"""The KVTransport interface (decode side pulls a prompt's K/V into blocks it reserved) and its
gRPC implementation.

Contract of `pull`: the transport asks the prefill worker to prefill, checks every chunk's
layout, ranges and size before handing it to `dest.write` (whose only way to the bytes,
ReceivedChunk.checked_tensor, checks the checksum right before the copy), checks that every
(layer, block) arrived exactly once, acknowledges so the prefill worker frees its blocks, and
returns the first token. On any failure or cancellation it tells the prefill worker explicitly
(abort message, then stream cancel) and raises; it never writes after returning or raising.

With a shared-memory arena (same node, kvrelay.kvtransfer.shm), the decode side offers a
region of it in PrefillStart; a prefill worker that can open it writes the chunks' bytes there and
sends only their headers, and everything else above stays as it is. With a doorbell beside the
arena (kvrelay.kvtransfer.doorbell), a prefill worker that can connect sends those headers,
PrefillDone and the ack between the two engine threads on a Unix socket; the gRPC stream then
carries only start, header, aborts and its end. The CUDA IPC plane below offers a doorbell too.

With a transfer engine (kvrelay.kvtransfer.mooncake: RDMA or TCP, any node), the arena's regions
are offered in PrefillStart.remote instead: the prefill worker writes each chunk's bytes into the
region before sending its header, and the decode side reads them as it reads a shared-memory
region. With the CUDA IPC plane (kvrelay.kvtransfer.cuda_ipc, same node, GPU caches), the prefill
worker names its cache's IPC handle in the header and its held blocks in each chunk; the decode
worker copies those device to device into its reservation and checks a GPU checksum of what
landed. The hand-off protocol (start, header, chunks, done, ack, aborts) is this module's on
every plane.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from kvrelay.engine.errors import InvalidRequestError
from kvrelay.engine.outputs import TokenLogprob
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.chunk_wire import PREFILL_METHOD, decode_server_message
from kvrelay.kvtransfer.convert import logprob_from_proto, params_to_proto
from kvrelay.kvtransfer.doorbell import DoorbellHandoff, DoorbellServer
from kvrelay.kvtransfer.errors import ChunkError, HandoffError, LayoutMismatchError, PrefillFailedError
from kvrelay.kvtransfer.grpc_options import channel_options
from kvrelay.kvtransfer.layout import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ChunkVerifier,
    KVLayout,
    ReceivedChunk,
    check_layout,
)
from kvrelay.kvtransfer.prefill_call import (
    StreamReader,
    abort_call,
    ack_on_stream,
    to_completion,
    watch_stream,
)
from kvrelay.kvtransfer.prompt_logprobs_wire import received_prompt_logprobs
from kvrelay.kvtransfer.shm import Region, ShmArena, SourceCaches
from kvrelay.kvtransfer.status import error_from_rpc

if TYPE_CHECKING:
    from kvrelay.kvtransfer.cuda_ipc import CudaIpcSources
    from kvrelay.kvtransfer.mooncake import MooncakeRegions
from kvrelay.v1 import kv_pb2

WriteFn = Callable[[list[ReceivedChunk]], Awaitable[None]]


@dataclass
class HandoffRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str = ""  # both sides hash the prompt's blocks from the same salted root
    deadline: float | None = None  # the request's deadline (time.monotonic()); None: only the hand-off timeout
    client_request_id: str = ""  # the client's X-Request-Id, for the prefill worker's log


@dataclass
class KVDestination:
    """Where the K/V goes: the decode worker's reserved blocks, in prompt order, and how to write them."""

    block_ids: list[int]  # with `reserved`, filled in place once it is done
    write: WriteFn  # checks each chunk's checksum and copies it into block_ids (on the engine thread)
    num_cached_blocks: int = 0  # leading block_ids that already hold their K/V (prefix-cache hits)
    # The same write, synchronous and callable from any thread (doorbell hand-offs); None: no doorbell.
    write_now: Callable[[list[ReceivedChunk]], None] | None = None
    # Early start (AsyncEngine.generate_prefilled): the blocks are still being reserved. The pull
    # sends PrefillStart at once and awaits `reserved` before it reads anything that leads to a
    # write; the doorbell thread calls `reserved_blocking` before it writes. Both raise if the
    # reservation failed.
    reserved: Callable[[], Awaitable[object]] | None = None
    reserved_blocking: Callable[[], object] | None = None


@dataclass
class HandoffResult:
    first_token: int
    first_logprob: TokenLogprob | None
    num_cached_tokens: int  # prompt tokens served by the prefill worker's prefix cache
    bytes: int
    seconds: float  # first chunk received -> last chunk written
    bytes_before_compute_done: int
    prefill_seconds: float
    plane: str = "grpc"  # where the bytes went: grpc (inline), shm (region, doorbell or direct), mooncake, cuda-ipc
    # The prompt's logprobs (None first), when the request asked for them (prompt_logprobs_wire).
    prompt_logprobs: list[TokenLogprob | None] | None = None


class KVTransport(abc.ABC):
    # Whether pull() honours KVDestination.reserved (an early start); a plugin that does not gets
    # its destination only once the blocks are reserved.
    early_start = False

    @abc.abstractmethod
    async def pull(self, prefill_addr: str, request: HandoffRequest, dest: KVDestination) -> HandoffResult:
        """Move the request's prompt K/V from prefill_addr into dest; see the module docstring."""

    async def close(self) -> None:
        """Release connections."""


_ERRORS_FROM_PREFILL = {grpc.StatusCode.FAILED_PRECONDITION: LayoutMismatchError}  # else PrefillFailedError


class GrpcKVTransport(KVTransport):
    """K/V travels inline on PrefillService.Prefill, a stream the decode side opens and reads."""

    early_start = True

    def __init__(self, layout: KVLayout, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 timeout_s: float = 300.0, arena: ShmArena | None = None, doorbell: DoorbellServer | None = None,
                 sources: SourceCaches | None = None, remote: MooncakeRegions | None = None,
                 cuda_ipc: CudaIpcSources | None = None):
        self.layout = layout
        # Given: the arena's regions are offered to a transfer engine (kvrelay.kvtransfer.mooncake),
        # not as shared memory; the prefill worker writes into them from any node.
        self.remote = remote
        if remote is not None:
            arena, doorbell, sources = remote.arena, None, None
        # Given: prefill workers on this node are offered the CUDA IPC plane (kvrelay.kvtransfer.cuda_ipc).
        self.cuda_ipc = cuda_ipc
        self.doorbell = doorbell  # offered with the arena's regions, or with the CUDA IPC plane
        # Given (a CPU cache): doorbell hand-offs may copy straight out of a prefill worker's
        # shared cache (the direct hand-off) instead of its region.
        self.sources = sources if doorbell is not None else None
        self.max_message_bytes = max_message_bytes
        self.timeout_s = timeout_s
        self.arena = arena  # offered to every prefill worker; those on this node write into it
        # A region whose prefill worker never confirmed the end of a failed hand-off returns to
        # the arena only after this long (the prefill side's lease is 30 s by default).
        self.shm_quarantine_s = 60.0
        # After the abort message, how long the prefill worker has to end the call before its
        # region is quarantined (it may still be writing into it). A fallback waits this long.
        self.abort_grace_s = 0.5
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._acks: set[asyncio.Task] = set()  # doorbell hand-offs' stream acks, still being written
        self._readers: set[asyncio.Task] = set()  # completed hand-offs' streams, read to their end

    def _prefill_call(self, addr: str, timeout_s: float | None = None,
                      client_request_id: str = "") -> grpc.aio.StreamStreamCall:
        ch = self._channels.get(addr)
        if ch is None:
            ch = self._channels[addr] = grpc.aio.insecure_channel(addr, options=channel_options(self.max_message_bytes))
        # Not the generated stub: chunk payloads are read as views of the received buffer.
        method = ch.stream_stream(PREFILL_METHOD, request_serializer=kv_pb2.PrefillClientMessage.SerializeToString,
                                  response_deserializer=decode_server_message)
        return method(timeout=timeout_s,
                      metadata=(("x-request-id", client_request_id),) if client_request_id else None)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        if self.sources is not None:
            self.sources.close()  # unmaps prefill workers' caches once no copy uses them
        if self.remote is not None:
            self.remote.close()
        if self.cuda_ipc is not None:
            self.cuda_ipc.close()

    async def pull(self, prefill_addr: str, request: HandoffRequest, dest: KVDestination) -> HandoffResult:
        # The request's deadline travels on as the prefill call's gRPC deadline.
        timeout_s = self.timeout_s
        if request.deadline is not None:
            timeout_s = max(0.001, min(timeout_s, request.deadline - time.monotonic()))
        call = self._prefill_call(prefill_addr, timeout_s, request.client_request_id)
        region = None
        nbytes = self.layout.bytes_for_blocks(_num_blocks(self.layout, request) - dest.num_cached_blocks)
        if self.arena is not None and nbytes:
            region = self.arena.allocate(nbytes)  # None when the arena is full: inline this time
        attempt = _Attempt(region, prefill_addr)
        reader = StreamReader(call)
        self._readers.add(reader.task)
        reader.task.add_done_callback(self._readers.discard)
        inner: asyncio.Task | None = None
        done_ok = False
        try:
            async with asyncio.timeout(timeout_s):
                start, verifier = self._prepare(request, dest, attempt)
                attempt.started = True
                # Written whole even if this task is cancelled meanwhile: a cancelled write cancels the RPC.
                await to_completion(call.write(kv_pb2.PrefillClientMessage(start=start)))
                # The exchange runs in its own task, which the clean-up can stop while the abort goes out.
                inner = asyncio.create_task(self._run(call, reader, start, verifier, request, dest, attempt))
                result = await asyncio.shield(inner)
            done_ok = True  # PrefillDone came after the last chunk: nothing more is placed
            return result
        except grpc.aio.AioRpcError as e:
            why = f"prefill worker {prefill_addr}: {e.code().name}: {e.details()}"
            if e.code() == grpc.StatusCode.INVALID_ARGUMENT:  # keeps the field it named (a 400 body's param)
                raise InvalidRequestError(why, error_from_rpc(e, prefill_addr).field) from None
            raise _ERRORS_FROM_PREFILL.get(e.code(), PrefillFailedError)(why) from None
        except TimeoutError:
            raise PrefillFailedError(f"prefill worker {prefill_addr}: no complete hand-off within "
                                     f"{timeout_s:.1f} s") from None
        finally:
            if attempt.doorbell is not None:
                self.doorbell.unregister(attempt.doorbell)  # before the caller frees the blocks
            # To its end even if this task is cancelled again meanwhile (a client that hangs up
            # while its abort is on the way): stopped halfway, it would strand the region.
            await to_completion(self._end(call, reader, inner, attempt, done_ok))

    async def _end(self, call, reader: StreamReader, inner: asyncio.Task | None, attempt: _Attempt,
                   done_ok: bool) -> None:
        """After a pull: end the exchange (unless it completed), then give the region back, or
        hold it while the prefill worker might still write into it."""
        writer_stopped = True  # no prefill-side code can still write into the region
        if not done_ok and inner is not None:
            attempt.giving_up = True  # the exchange writes no ack from now on: the abort below may
            if attempt.acking:  # unless it is writing it: PrefillDone came, let the ack go out
                await asyncio.gather(inner, return_exceptions=True)
            done_ok = inner.done() and not inner.cancelled() and inner.exception() is None
        # From here on, what nobody has read is dropped: the call's status can arrive, and a stream
        # that carries more than the protocol allows never holds the reader up.
        reader.discard()
        if done_ok:
            if attempt.watcher is not None:  # a doorbell hand-off completed: nothing left to watch
                attempt.watcher.cancel()
        elif not attempt.started:  # nothing went out: no prefill worker knows of it
            call.cancel()
        else:
            writer_stopped = await abort_call(call, "decode side gave up the hand-off", self.abort_grace_s)
            tasks = [t for t in (inner, attempt.watcher, reader.task) if t is not None]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if attempt.region is not None:
            if writer_stopped:
                self.arena.free(attempt.region)  # engine-thread writes already queued only read it
            else:
                # The prefill worker never confirmed it stopped: it might still be copying a
                # chunk into the region, which must not reach another hand-off's K/V.
                asyncio.get_running_loop().call_later(self.shm_quarantine_s, self.arena.free, attempt.region)

    def _prepare(self, request: HandoffRequest, dest: KVDestination,
                 attempt: _Attempt) -> tuple[kv_pb2.PrefillStart, ChunkVerifier]:
        """PrefillStart with the planes offered, and the verifier of what comes back; a doorbell
        is registered here, before the prefill worker can ring."""
        region = attempt.region
        start = kv_pb2.PrefillStart(
            request_id=request.request_id, prompt_token_ids=request.prompt_ids,
            params=params_to_proto(request.params), priority=request.priority,
            expected_layout=self.layout.to_proto(), max_message_bytes=self.max_message_bytes,
            num_cached_blocks=dest.num_cached_blocks, cache_salt=request.cache_salt)
        num_blocks = _num_blocks(self.layout, request)
        verifier = ChunkVerifier(self.layout, len(request.prompt_ids), num_blocks, dest.num_cached_blocks)
        if self.cuda_ipc is not None:
            offer = self.cuda_ipc.offer(attempt.prefill_addr)
            if offer is not None:
                if self.doorbell is not None and dest.write_now is not None:
                    # Registered before the prefill worker can ring, as below.
                    attempt.doorbell = self._register_doorbell(verifier, None, dest, attempt.prefill_addr)
                    offer.doorbell, offer.ticket = str(self.doorbell.path), attempt.doorbell.ticket
                start.cuda_ipc.CopyFrom(offer)
        if region is not None and self.remote is not None:
            start.remote.CopyFrom(self.remote.offer(region))
        elif region is not None:
            start.shm.CopyFrom(kv_pb2.ShmRegion(path=str(self.arena.path), nonce=self.arena.nonce,
                                                offset=region.offset, size=region.size))
            if self.doorbell is not None and dest.write_now is not None and attempt.doorbell is None:
                # Registered before the prefill worker can ring: its first frame may come before
                # the header is read here.
                attempt.doorbell = self._register_doorbell(verifier, _ShmReader(self.arena, region), dest)
                start.shm.doorbell, start.shm.ticket = str(self.doorbell.path), attempt.doorbell.ticket
                start.shm.direct = self.sources is not None
                if self.sources is not None:
                    self.sources.prune()
        return start, verifier

    async def _run(self, call, reader: StreamReader, start: kv_pb2.PrefillStart, verifier: ChunkVerifier,
                   request: HandoffRequest, dest: KVDestination, attempt: _Attempt) -> HandoffResult:
        region, num_blocks = attempt.region, verifier.num_blocks
        if dest.reserved is not None:  # the prefill computes meanwhile; its messages wait in the stream
            await dest.reserved()
        rx = await reader.next()
        if rx.kind() != "header":
            raise PrefillFailedError(f"hand-off began with {rx.kind()!r}, expected a header")
        header = rx.msg.header
        t0 = None  # first chunk received: transfer time excludes waiting for the prefill to start
        check_layout(self.layout, KVLayout.from_proto(header.layout), "hand-off header")
        if header.num_tokens != len(request.prompt_ids) or header.num_blocks != num_blocks:
            raise ChunkError(f"prefill worker describes {header.num_tokens} tokens in {header.num_blocks} blocks; "
                             f"decode reserved {num_blocks} blocks for {len(request.prompt_ids)} tokens")
        if header.shm and (region is None or self.remote is not None):
            raise ChunkError("prefill worker chose the shared-memory data plane, which this decode worker did "
                             "not offer")
        if header.remote and (region is None or self.remote is None):
            raise ChunkError("prefill worker chose the remote data plane, which this decode worker did not offer")
        ipc_source = None
        if header.HasField("cuda_ipc"):
            if not start.HasField("cuda_ipc"):
                raise ChunkError("prefill worker chose the CUDA IPC plane, which this decode worker did not offer")
            if not header.doorbell:  # else the doorbell's frames carry the handle
                ipc_source = self.cuda_ipc.open(attempt.prefill_addr, header.cuda_ipc)  # ChunkError if it cannot
        if header.doorbell:
            if attempt.doorbell is None:
                raise ChunkError("prefill worker chose the doorbell, which this decode worker did not offer")
            if start.cuda_ipc.doorbell and not header.HasField("cuda_ipc"):
                raise ChunkError("prefill worker rang the CUDA IPC plane's doorbell without the plane")
            return await self._await_doorbell(call, reader, attempt, verifier, request,
                                              "cuda-ipc" if header.HasField("cuda_ipc") else "shm")
        if attempt.doorbell is not None:  # the prefill worker cannot reach the socket: the stream carries all
            self.doorbell.unregister(attempt.doorbell)
            attempt.doorbell = None
        shm = _ShmReader(self.arena, region) if header.shm or header.remote else None
        plane = "cuda-ipc" if ipc_source is not None else "mooncake" if header.remote else "shm" if header.shm else "grpc"
        writer = _BatchWriter(dest.write)
        try:
            while True:
                rx = await reader.next()
                kind, msg = rx.kind(), rx.msg
                if kind == "chunk":
                    t0 = t0 or time.monotonic()
                    if ipc_source is not None:  # copied device to device on the engine thread
                        writer.add(self.cuda_ipc.accept(verifier, msg.chunk, ipc_source))
                        continue
                    payload = rx.payload if shm is None else shm.payload(msg.chunk)
                    writer.add(verifier.accept(msg.chunk, payload))
                elif kind == "done":
                    await writer.drain()
                    verifier.check_complete()
                    prompt_lps = _prompt_logprobs(msg.done, request)
                    if attempt.giving_up:  # the clean-up is sending the abort
                        raise asyncio.CancelledError
                    attempt.acking = True
                    await call.write(kv_pb2.PrefillClientMessage(ack=kv_pb2.PrefillAck()))
                    await call.done_writing()
                    done = msg.done
                    return HandoffResult(
                        first_token=done.first_token_id,
                        first_logprob=logprob_from_proto(done.first_logprob) if done.has_logprob else None,
                        num_cached_tokens=done.num_cached_tokens, bytes=verifier.bytes,
                        seconds=time.monotonic() - (t0 or time.monotonic()),
                        bytes_before_compute_done=done.bytes_before_compute_done,
                        prefill_seconds=done.prefill_seconds, plane=plane, prompt_logprobs=prompt_lps)
                elif kind == "aborted":
                    raise PrefillFailedError(f"prefill worker aborted the hand-off: {msg.aborted.reason}")
                else:
                    raise PrefillFailedError(f"unexpected {kind!r} message in the hand-off stream")
        finally:
            await writer.close()


    def _register_doorbell(self, verifier: ChunkVerifier, shm: _ShmReader | None, dest: KVDestination,
                           ipc_from: str = "") -> DoorbellHandoff:
        """shm: the offered region's reader; ipc_from: the prefill worker offered the CUDA IPC plane."""
        loop = asyncio.get_running_loop()

        def accept(chunk: kv_pb2.KVChunk, frame: kv_pb2.DoorbellFrame):
            if ipc_from:
                if not frame.HasField("cuda_ipc"):
                    raise ChunkError("a KV chunk on the CUDA IPC plane's doorbell came without the cache handle")
                return self.cuda_ipc.accept(verifier, chunk, self.cuda_ipc.open(ipc_from, frame.cuda_ipc))
            if not chunk.source_block_ids:
                return verifier.accept(chunk, shm.payload(chunk))
            source = frame.source if frame.HasField("source") else None
            if source is None or self.sources is None:
                raise ChunkError("a direct KV chunk came without a shared cache this decode worker offered to read")
            try:
                cache = self.sources.open(source)
            except (OSError, ValueError) as e:
                raise ChunkError(f"cannot map the prefill worker's shared KV cache {source.path}: {e}") from e
            return verifier.accept_direct(chunk, cache)

        h = DoorbellHandoff(ticket=secrets.token_bytes(16), accept=accept,
                            check_complete=verifier.check_complete, write=dest.write_now, loop=loop,
                            future=loop.create_future(), ready=dest.reserved_blocking)
        self.doorbell.register(h)
        return h

    async def _await_doorbell(self, call, reader: StreamReader, attempt: _Attempt, verifier: ChunkVerifier,
                              request: HandoffRequest, plane: str) -> HandoffResult:
        """The chunks and PrefillDone come on the doorbell (from the prefill worker's engine or
        ringer thread, written by this worker's doorbell thread); the stream can only end the
        hand-off early (aborted, closed, broken)."""
        h = attempt.doorbell
        attempt.watcher = asyncio.create_task(watch_stream(reader, h))
        done = await h.future
        prompt_lps = _prompt_logprobs(done, request)
        # The doorbell acked from its thread already; this ack covers a lost one, off the TTFT's path.
        task = asyncio.create_task(ack_on_stream(call))
        self._acks.add(task)
        task.add_done_callback(self._acks.discard)
        return HandoffResult(
            first_token=done.first_token_id,
            first_logprob=logprob_from_proto(done.first_logprob) if done.has_logprob else None,
            num_cached_tokens=done.num_cached_tokens, bytes=verifier.bytes,
            seconds=h.written_at - (h.first_chunk_at or h.written_at),  # both set before the future resolves
            bytes_before_compute_done=done.bytes_before_compute_done, prefill_seconds=done.prefill_seconds,
            plane=plane, prompt_logprobs=prompt_lps)


@dataclass(eq=False)
class _Attempt:
    """One pull's resources, for its clean-up."""

    region: Region | None
    prefill_addr: str = ""
    doorbell: DoorbellHandoff | None = None
    watcher: asyncio.Task | None = None  # watches the stream of a doorbell hand-off
    started: bool = False  # PrefillStart went out (or is going)
    giving_up: bool = False  # the clean-up is ending the call
    acking: bool = False  # the exchange is writing its ack (the one write besides PrefillStart)


class _ShmReader:
    """Where each chunk's bytes lie in the offered region: back to back from its start, in the
    order the chunks arrive, so a chunk can never overlap one already verified."""

    def __init__(self, arena: ShmArena, region: Region):
        self.view = arena.view[region.offset:region.offset + region.size]
        self.next = 0

    def payload(self, chunk: kv_pb2.KVChunk):
        if chunk.data:
            raise ChunkError("KV chunk carries inline data on the shared-memory data plane")
        if chunk.shm_offset != self.next or chunk.shm_offset + chunk.shm_size > len(self.view):
            raise ChunkError(f"KV chunk at shared-memory bytes [{chunk.shm_offset}, "
                             f"{chunk.shm_offset + chunk.shm_size}): expected it to start at {self.next} and "
                             f"end within the region's {len(self.view)} B")
        self.next += chunk.shm_size
        return self.view[chunk.shm_offset:self.next]


def _num_blocks(layout: KVLayout, request: HandoffRequest) -> int:
    """The blocks a prompt's reservation holds (its last token's too)."""
    return -(-len(request.prompt_ids) // layout.block_size)


def _prompt_logprobs(done: kv_pb2.PrefillDone, request: HandoffRequest) -> list[TokenLogprob | None] | None:
    try:
        return received_prompt_logprobs(done, request.prompt_ids, request.params.prompt_logprobs)
    except ValueError as e:  # another prefill worker, or a local prefill, can still score the prompt
        raise PrefillFailedError(str(e)) from None


class _BatchWriter:
    """Writes verified chunks in batches: while one engine-thread write runs, the next ones queue,
    so the receive loop never waits on the engine between chunks."""

    def __init__(self, write: WriteFn):
        self._write = write
        self._pending: list[ReceivedChunk] = []
        self._task: asyncio.Task | None = None

    def add(self, chunk: ReceivedChunk) -> None:
        if self._task is not None and self._task.done():
            self._task.result()  # surface a failed write now
        self._pending.append(chunk)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            await self._write(batch)

    async def drain(self) -> None:
        """Wait until every added chunk is written (add() keeps a task running while any is pending)."""
        if self._task is not None:
            await self._task  # raises if a write failed

    async def close(self) -> None:
        """Stop writing: the caller frees the blocks after this returns."""
        self._pending.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):  # already failing, or failed unread
                await self._task


def is_retryable(err: HandoffError) -> bool:
    return isinstance(err, (PrefillFailedError, ChunkError))
