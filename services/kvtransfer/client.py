"""Python client of the workers, used by the gateway and the tests.

    client = DecodeClient("decode-0:50051")
    async for out in client.generate(prompt_ids, params, request_id, prefill_addr="prefill-0:50051"):
        ...  # kvrelay.engine.outputs.RequestOutput, exactly as the engine yields them
    await client.abort(request_id)
    async for report in watch_load("decode-0:50051"): ...  # LoadReport every interval

Errors raised: InvalidRequestError / PromptTooLongError (bad input), NoCapacityError (decode
worker cannot hold the prompt now: pick another), LayoutMismatchError, WorkerUnavailableError
(worker unreachable, or no prefill worker could serve and local prefill is off), HandoffError.
Closing the iterator early cancels the stream and sends an explicit Abort.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence

import grpc
from kvrelay.engine.outputs import RequestOutput
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.convert import output_from_proto, params_to_proto
from kvrelay.kvtransfer.errors import WorkerUnavailableError
from kvrelay.kvtransfer.grpc_options import channel_options
from kvrelay.kvtransfer.layout import DEFAULT_MAX_MESSAGE_BYTES
from kvrelay.kvtransfer.load import LoadReport
from kvrelay.kvtransfer.prompt_logprobs_wire import DECODE_HOP, check_prompt_logprobs_fit
from kvrelay.kvtransfer.status import error_from_rpc
from kvrelay.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    load_pb2,
    load_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)

__all__ = ["DecodeClient", "LoadReport", "PrefillClient", "watch_load"]


class _Client:
    def __init__(self, addr: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        self.addr = addr
        self.max_message_bytes = max_message_bytes
        self._channel = grpc.aio.insecure_channel(addr, options=channel_options(max_message_bytes + 65536))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class DecodeClient(_Client):
    def __init__(self, addr: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        super().__init__(addr, max_message_bytes)
        self._stub = decode_pb2_grpc.DecodeServiceStub(self._channel)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        prefill_addr: str | Sequence[str] | None = None,
        priority: int = 0,
        allow_local_prefill: bool = True,
        cache_salt: str | None = None,
        timeout_s: float | None = None,
        metadata: Sequence[tuple[str, str]] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request, prefilled on prefill_addr (tried in order if several; None:
        on the decode worker itself). allow_local_prefill: whether the decode worker may prefill
        itself when every prefill worker failed. timeout_s: the call's gRPC deadline (the decode
        worker passes what is left of it to its prefill call; DeadlineExceededError on expiry)."""
        request_id = request_id or uuid.uuid4().hex
        if params.prompt_logprobs is not None and not isinstance(prompt, str):  # before the worker computes them
            check_prompt_logprobs_fit(len(prompt), params.prompt_logprobs, self.max_message_bytes, DECODE_HOP)
        addrs = [prefill_addr] if isinstance(prefill_addr, str) else list(prefill_addr or [])
        req = decode_pb2.GenerateRequest(request_id=request_id, params=params_to_proto(params), priority=priority,
                                         prefill_addrs=addrs, allow_local_prefill=allow_local_prefill,
                                         cache_salt=cache_salt or "")
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.CopyFrom(common_pb2.TokenIds(ids=prompt))
        call = self._stub.Generate(req, timeout=timeout_s, metadata=tuple(metadata or ()))
        settled = False  # the server ended the call (normally or with an error): nothing to abort
        try:
            async for resp in call:
                yield output_from_proto(resp.output)
            settled = True
        except grpc.aio.AioRpcError as e:
            settled = True
            raise error_from_rpc(e, self.addr) from None
        finally:
            if not settled:  # explicit abort first, so the worker frees at once, then drop the stream
                await asyncio.shield(self._abort_quietly(request_id))
                call.cancel()

    async def abort(self, request_id: str, reason: str = "client abort") -> bool:
        """True if the worker knew the request."""
        try:
            reply = await self._stub.Abort(prefill_pb2.AbortRequest(request_id=request_id, reason=reason), timeout=5)
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e, self.addr) from None
        return reply.found

    async def _abort_quietly(self, request_id: str) -> None:
        try:
            await self._stub.Abort(prefill_pb2.AbortRequest(request_id=request_id, reason="client closed the stream"),
                                   timeout=1)
        except grpc.aio.AioRpcError:
            pass  # the worker is gone: nothing left to free there


class PrefillClient(_Client):
    def __init__(self, addr: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES):
        super().__init__(addr, max_message_bytes)
        self._stub = prefill_pb2_grpc.PrefillServiceStub(self._channel)

    async def abort(self, request_id: str, reason: str = "client abort") -> bool:
        try:
            reply = await self._stub.Abort(prefill_pb2.AbortRequest(request_id=request_id, reason=reason), timeout=5)
        except grpc.aio.AioRpcError as e:
            raise error_from_rpc(e, self.addr) from None
        return reply.found


async def watch_load(addr: str, interval_s: float = 0.0) -> AsyncIterator[LoadReport]:
    """Reports from the worker at addr until the stream breaks (raises WorkerUnavailableError:
    treat the worker as dead). interval_s 0: the worker's default. Each report's
    prefix_hashes_current holds the worker's full current set of prefix-cache block keys."""
    async with grpc.aio.insecure_channel(addr, options=channel_options()) as channel:
        stub = load_pb2_grpc.LoadServiceStub(channel)
        current: set[int] = set()
        try:
            async for msg in stub.WatchLoad(load_pb2.WatchLoadRequest(interval_ms=int(interval_s * 1000))):
                report = LoadReport.from_proto(msg)
                if report.prefix_hashes is not None:
                    current = report.prefix_hashes
                report.prefix_hashes_current = current
                yield report
        except grpc.aio.AioRpcError as e:
            raise WorkerUnavailableError(f"load stream of {addr} broke: {e.code().name}: {e.details()}") from None
        raise WorkerUnavailableError(f"load stream of {addr} ended: the worker is shutting down")
