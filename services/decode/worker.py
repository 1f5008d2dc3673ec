"""The decode worker: admits a request only if its prompt's blocks can be reserved now, pulls the
prompt's K/V from a prefill worker into those blocks (KVTransport), then continues generation in
its continuous batch and streams outputs back (DecodeService.Generate).

Failure handling: a prefill worker that dies, refuses or sends a bad chunk before the hand-off
completes costs the reservation (freed after the last write, on the engine thread) and the
request moves on to the next prefill worker, then to a local prefill (unless disabled). A
layout mismatch or a full cache is the caller's to fix and is reported, not retried.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from pathlib import Path

import grpc
import torch
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.block_pool import NoFreeBlocksError
from kvrelay.engine.errors import EngineDeadError, InvalidRequestError
from kvrelay.engine.handoff import Reservation
from kvrelay.engine.outputs import RequestOutput
from kvrelay.kvtransfer.convert import output_to_proto, params_from_proto
from kvrelay.kvtransfer.doorbell import DoorbellServer
from kvrelay.kvtransfer.errors import (
    ChunkError,
    HandoffError,
    NoCapacityError,
    PrefillFailedError,
    RequestAbortedError,
    WorkerUnavailableError,
)
from kvrelay.kvtransfer.layout import DirectChunk, ReceivedChunk
from kvrelay.kvtransfer.planes import BUILTIN as BUILTIN_PLANES
from kvrelay.kvtransfer.planes import builtin_transport
from kvrelay.kvtransfer.prompt_logprobs_wire import DECODE_HOP, check_prompt_logprobs_fit
from kvrelay.kvtransfer.shm import LockedFile, ShmArena, SourceCaches, doorbell_path
from kvrelay.kvtransfer.status import abort_with
from kvrelay.kvtransfer.transport import GrpcKVTransport, HandoffRequest, KVDestination, KVTransport
from kvrelay.kvtransfer.transport_plugins import plugin_transport
from kvrelay.kvtransfer.worker_base import WorkerBase, WorkerOptions
from kvrelay.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _Request:
    request_id: str
    handoff_task: asyncio.Task | None = None  # the KV pull in progress
    aborted: bool = False
    num_cached_tokens: int | None = None  # reported by the prefill worker
    cache_salt: str | None = None  # prefix-cache salt, hashed alike here and on the prefill worker
    deadline: float | None = None  # the caller's gRPC deadline (time.monotonic()), passed on to prefill calls
    client_request_id: str = ""  # the client's X-Request-Id (call metadata), logged and passed on
    prompt_logprobs: list | None = None  # from the prefill worker, until the first output carries them


class DecodeWorker(WorkerBase, decode_pb2_grpc.DecodeServiceServicer):
    role = "decode"

    def __init__(self, engine: AsyncEngine, options: WorkerOptions | None = None,
                 transport: KVTransport | None = None):
        super().__init__(engine, options)
        self.arena = self.doorbell = self.anchor = None
        if transport is None and self.options.kv_transport in BUILTIN_PLANES:
            transport = builtin_transport(self.options.kv_transport, self.layout, self.options, self.metrics,
                                          engine.engine.device)
            if transport.cuda_ipc is not None and self.options.kv_doorbell:
                transport.doorbell = self.doorbell = self._open_ipc_doorbell()
        elif transport is None and self.options.kv_transport:
            transport = plugin_transport(self.options.kv_transport, self.layout, self.options)
        if transport is None and self.options.kv_shm_bytes:
            self.arena = ShmArena(self.options.kv_shm_bytes, self.options.kv_shm_dir)
            self.metrics.track_shm_arena(self.arena)
            self.doorbell = self._open_doorbell(self.arena.path) if self.options.kv_doorbell else None
        # Direct hand-offs copy from a prefill worker's cache into ours: host memory to host memory.
        sources = SourceCaches(self.layout) if engine.engine.device.type == "cpu" else None
        self.transport = transport or GrpcKVTransport(self.layout, self.options.max_message_bytes,
                                                      self.options.handoff_timeout_s, self.arena, self.doorbell,
                                                      sources)
        self.load.kv_shm = self.arena is not None
        self._requests: dict[str, _Request] = {}
        # Ask the prefill worker to start while the engine thread reserves (it waits for the step in flight).
        self.early_start = self.options.kv_early_start and self.transport.early_start

    def _open_doorbell(self, beside: Path) -> DoorbellServer | None:
        path = doorbell_path(beside)
        try:
            return DoorbellServer(path)
        except OSError as e:  # e.g. a path over the 107-byte limit of Unix sockets
            log.warning("no doorbell at %s (%s): same-node hand-offs signal over gRPC", path, e)
            return None

    def _open_ipc_doorbell(self) -> DoorbellServer | None:
        """The CUDA IPC plane's doorbell: a socket beside an empty locked file in --kv-shm-dir (with
        hostIPC, /dev/shm is the node's, where the prefill pods see it too)."""
        try:
            self.anchor = LockedFile(self.options.kv_shm_dir)
        except OSError as e:
            log.warning("no doorbell in %s (%s): CUDA IPC hand-offs signal over gRPC", self.options.kv_shm_dir, e)
            return None
        doorbell = self._open_doorbell(self.anchor.path)
        if doorbell is None:
            self.anchor.close()
            self.anchor = None
        return doorbell

    def add_services(self, server: grpc.aio.Server) -> None:
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(self, server)

    def active_handoffs(self) -> int:
        return sum(1 for r in self._requests.values() if r.handoff_task is not None)

    async def stop(self, grace_s: float = 1.0) -> None:
        await super().stop(grace_s)
        await self.transport.close()
        if self.doorbell is not None:
            self.doorbell.close()
        if self.arena is not None:
            self.arena.close()
        if self.anchor is not None:
            self.anchor.close()

    # ---- RPCs ---------------------------------------------------------------------------------

    async def Abort(self, request, context):
        req = self._requests.get(request.request_id)
        if req is None:
            return prefill_pb2.AbortReply(found=False)
        req.aborted = True
        self.metrics.aborts.labels("client").inc()
        if req.handoff_task is not None:
            req.handoff_task.cancel()  # the transport aborts towards the prefill worker
        await self.engine.abort(request.request_id)
        return prefill_pb2.AbortReply(found=True)

    async def Generate(self, request, context):
        rid = request.request_id or uuid.uuid4().hex
        if rid in self._requests:
            await abort_with(context, InvalidRequestError(f"request_id {rid!r} is already in use", "request_id"))
        arrival = time.monotonic()
        left = context.time_remaining()  # None without a deadline
        req = self._requests[rid] = _Request(
            rid, cache_salt=request.cache_salt or None, deadline=None if left is None else arrival + left,
            client_request_id=dict(context.invocation_metadata() or ()).get("x-request-id", ""))
        last = None
        outcome, generated = "error", 0
        try:
            params = params_from_proto(request.params)
            prompt = request.text if request.WhichOneof("prompt") == "text" else list(request.token_ids.ids)
            ids = self.engine.engine.tokenize_prompt(prompt)
            if params.prompt_logprobs is not None:  # they reach the client in one message
                check_prompt_logprobs_fit(len(ids), params.prompt_logprobs, self.options.max_message_bytes,
                                          DECODE_HOP)
            outputs = self._serve(req, ids, params, request.priority, list(request.prefill_addrs),
                                  request.allow_local_prefill)
            async for out in outputs:
                now = time.monotonic()
                if out.new_token_ids:
                    if last is None:
                        self.metrics.ttft.observe(now - arrival)
                    else:
                        self.metrics.itl.observe(now - last)
                    last = now
                if out.finished:
                    self.metrics.e2e.observe(now - arrival)
                    outcome = out.finish_reason
                generated = out.num_generated_tokens
                yield decode_pb2.GenerateResponse(output=output_to_proto(out, req.num_cached_tokens))
        except (InvalidRequestError, HandoffError, NoFreeBlocksError, EngineDeadError) as e:
            outcome = type(e).__name__
            await abort_with(context, e)
        except asyncio.CancelledError:  # the client hung up, or its deadline passed
            outcome = "cancelled"
            if not req.aborted:
                self.metrics.aborts.labels("client").inc()
            raise
        finally:
            self._requests.pop(rid, None)
            log.info("request %s ended: %s, %d tokens in %.3f s (x-request-id %s)", rid, outcome, generated,
                     time.monotonic() - arrival, req.client_request_id or "-")

    # ---- serving ----------------------------------------------------------------------------

    async def _serve(self, req: _Request, ids: list[int], params, priority: int, prefill_addrs: list[str],
                     allow_local: bool):
        if params.n == 1 and prefill_addrs:
            # The prefill worker scores the prompt; this engine never computes it (and so may use
            # its prefix cache for it): the prefill worker's prompt logprobs go out with the first output.
            local = params if params.prompt_logprobs is None else dataclasses.replace(params, prompt_logprobs=None)
            errors = []
            for i, addr in enumerate(prefill_addrs):
                try:
                    finished = False
                    async for out in self.engine.generate_prefilled(
                            ids, local, req.request_id, priority,
                            lambda res, addr=addr: self._load_kv(req, addr, ids, params, priority, res),
                            cache_salt=req.cache_salt, early_start=self.early_start):
                        finished = out.finished
                        if req.prompt_logprobs is not None and (out.new_token_ids or out.finished):
                            out.prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, None
                        yield out
                    if not finished:  # aborted between the last write and activation
                        yield self._aborted_output(req, ids)
                    return
                except NoFreeBlocksError as e:
                    self.metrics.failures.labels("no_free_blocks").inc()
                    raise NoCapacityError(f"decode worker cannot hold the prompt's {len(ids)} tokens now ({e}); "
                                          f"route the request to another decode worker") from None
                except RequestAbortedError:
                    yield self._aborted_output(req, ids)
                    return
                except (PrefillFailedError, ChunkError) as e:
                    if req.aborted:
                        yield self._aborted_output(req, ids)
                        return
                    log.warning("remote prefill of %s on %s failed: %s", req.request_id, addr, e)
                    self.metrics.failures.labels(type(e).__name__).inc()
                    errors.append(f"{addr}: {e}")
                    # The failed attempt's abort is queued on the engine thread; wait until it ran.
                    await self.engine.call_in_engine_thread(lambda llm: None)
                    if i + 1 < len(prefill_addrs):
                        self.metrics.fallbacks.labels("retry").inc()
            if not (allow_local and self.options.allow_local_prefill):
                raise WorkerUnavailableError("no prefill worker could serve the request and local prefill is "
                                             "disabled: " + "; ".join(errors))
            self.metrics.fallbacks.labels("local").inc()
        elif params.n == 1 and not (allow_local and self.options.allow_local_prefill):
            raise WorkerUnavailableError("no prefill worker given and local prefill is disabled")
        if req.aborted:
            yield self._aborted_output(req, ids)
            return
        req.num_cached_tokens = req.prompt_logprobs = None  # this engine scores the prompt itself
        async for out in self.engine.generate(ids, params, req.request_id, priority, cache_salt=req.cache_salt):
            yield out

    async def _load_kv(self, req: _Request, addr: str, ids: list[int], params, priority: int, res: Reservation):
        """load_kv of AsyncEngine.generate_prefilled: pull the K/V of the blocks after the
        prefix-cache hits, return the first token. With an early start the PrefillStart goes out
        while the engine thread still reserves; writes wait for the reservation."""
        if req.aborted:
            raise RequestAbortedError(f"request {req.request_id} was aborted")
        block_ids, llm, rid = res.block_ids, self.engine.engine, req.request_id  # block_ids: filled in place
        wait_s = self.options.handoff_timeout_s
        dest = KVDestination(block_ids, lambda batch: self._write(rid, block_ids, batch), res.num_cached_blocks,
                             lambda batch: _write_blocks(llm, rid, block_ids, batch),
                             reserved=None if res.done else res.wait,
                             reserved_blocking=None if res.done else lambda: res.wait_blocking(wait_s))
        req.handoff_task = asyncio.create_task(
            self.transport.pull(addr, HandoffRequest(req.request_id, ids, params, priority, req.cache_salt or "",
                                         req.deadline, req.client_request_id), dest))
        try:
            result = await req.handoff_task
        except asyncio.CancelledError:
            if req.aborted and not asyncio.current_task().cancelling():
                raise RequestAbortedError(f"request {req.request_id} was aborted during its KV transfer") from None
            raise
        finally:
            req.handoff_task = None
        m = self.metrics
        m.kv_seconds.observe(result.seconds)
        m.kv_bytes.inc(result.bytes)
        m.kv_plane_seconds.labels(result.plane).observe(result.seconds)
        m.kv_plane_bytes.labels(result.plane).inc(result.bytes)
        m.kv_overlap_bytes.inc(result.bytes_before_compute_done)
        if result.seconds > 0:
            m.kv_speed.observe(result.bytes / result.seconds / 1e9)
        m.kv_handoffs.labels("ack").inc()
        if params.prompt_logprobs is not None and result.prompt_logprobs is None:  # e.g. a plugin transport
            raise PrefillFailedError(f"the {result.plane} hand-off brought no prompt logprobs")
        req.prompt_logprobs = result.prompt_logprobs
        req.num_cached_tokens = result.num_cached_tokens
        return result.first_token, result.first_logprob

    async def _write(self, rid: str, block_ids: list[int], batch: list[ReceivedChunk]) -> None:
        await self.engine.call_in_engine_thread(lambda llm: _write_blocks(llm, rid, block_ids, batch))

    def _aborted_output(self, req: _Request, ids: list[int]) -> RequestOutput:
        return RequestOutput(request_id=req.request_id, index=0, new_token_ids=[], text="", logprobs=None,
                             finish_reason="abort", stop_reason=None, num_prompt_tokens=len(ids),
                             num_generated_tokens=0)


def _write_blocks(llm, rid: str, block_ids: list[int], batch: list[ReceivedChunk | DirectChunk]) -> None:
    """Check each chunk's checksum and copy it into the request's reserved blocks, only while the
    request still holds exactly those blocks (LLMEngine.write_reserved; any thread). A corrupted
    chunk raises ChunkError before any of its bytes is written; a direct one after its copy into
    the still-unused reserved blocks (DirectChunk), which the failed hand-off then frees."""

    def scatter() -> None:
        ids = torch.tensor(block_ids, dtype=torch.long, device=llm.device)
        for chunk in batch:
            r = chunk.range
            if llm.executor is not None:  # tensor/pipeline parallel: each rank writes its heads and layers
                llm.executor.scatter_blocks(block_ids[r.block_start:r.block_end], chunk.checked_tensor(),
                                            r.layer_start, r.layer_end)
                continue
            if isinstance(chunk, DirectChunk):  # from the prefill worker's shared cache, checked after
                chunk.copy_into(llm.kv_cache, block_ids[r.block_start:r.block_end])
                continue
            llm.ops.scatter_blocks(llm.kv_cache, ids[r.block_start:r.block_end],
                                   chunk.checked_tensor().to(llm.device), r.layer_start, r.layer_end)

    if not llm.write_reserved(rid, block_ids, scatter):
        raise RequestAbortedError(f"request {rid} no longer holds its reserved blocks: write dropped")
