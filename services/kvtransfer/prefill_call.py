"""The decode side's helpers for its PrefillService call: the stream's one reader, the explicit
abort (then the cancel), the ack on the stream, a doorbell hand-off's stream watcher, and running a
clean-up to its end through a second cancel. transport.py runs the hand-off protocol with them."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from kvrelay.kvtransfer.chunk_wire import ServerMessage
from kvrelay.kvtransfer.doorbell import DoorbellHandoff
from kvrelay.kvtransfer.errors import PrefillFailedError
from kvrelay.v1 import kv_pb2


async def to_completion(coro) -> None:
    """Await coro as a task that runs to its end whatever happens to the awaiting task; a cancel
    that arrives meanwhile is raised once it has ended."""
    task = asyncio.ensure_future(coro)
    cancelled = False
    while not task.done():
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    task.result()


class StreamReader:
    """The one reader of a hand-off's stream: a task reads the call into a one-message queue.

    Two gRPC rules shape it. The call's status arrives only once its messages have been read, so
    ending a call needs someone reading, whatever the exchange is waiting for (a reservation, an
    engine write) when the decode side gives up. And cancelling a task blocked in call.read()
    cancels the RPC, before the explicit abort could go out; the exchange waits on the queue
    instead, and may be cancelled at any point but a write. The queue's bound keeps gRPC's flow
    control: the prefill worker is held back while the decode side is not reading."""

    def __init__(self, call):
        self._queue: asyncio.Queue = asyncio.Queue(1)
        self._discarding = False
        self.task = asyncio.create_task(self._pump(call))

    async def _pump(self, call) -> None:
        try:
            while True:
                msg = await call.read()
                if not self._discarding:
                    await self._queue.put(msg)
                if msg is grpc.aio.EOF:
                    return
        except Exception as e:  # noqa: BLE001 - the stream's error (AioRpcError) goes to whoever reads next
            if not self._discarding:
                await self._queue.put(e)

    async def next(self) -> ServerMessage:
        """The next message; raises the stream's error, or PrefillFailedError when it ended."""
        if self._discarding:
            raise PrefillFailedError("the decode side gave up the hand-off")
        item = await self._queue.get()
        if isinstance(item, Exception):
            raise item
        if item is grpc.aio.EOF:
            raise PrefillFailedError("the prefill worker closed the hand-off stream early")
        return item

    def discard(self) -> None:
        """From now on read and drop whatever comes, so the call's status can arrive."""
        self._discarding = True
        while not self._queue.empty():  # unblocks a pump waiting to put
            self._queue.get_nowait()


async def ack_on_stream(call) -> None:
    with contextlib.suppress(Exception):  # the call may have ended on the doorbell's ack
        await call.write(kv_pb2.PrefillClientMessage(ack=kv_pb2.PrefillAck()))
        await call.done_writing()


async def watch_stream(reader: StreamReader, h: DoorbellHandoff) -> None:
    """A doorbell hand-off's stream: anything before the hand-off completes ends it (the first
    outcome wins, so what comes after it completed is dropped)."""
    while True:
        try:
            rx = await reader.next()
        except Exception as e:  # noqa: BLE001 - closed early or broken: pull maps it like any stream error
            h.resolve(e)
            return
        if rx.kind() == "aborted":
            h.resolve(PrefillFailedError(f"prefill worker aborted the hand-off: {rx.msg.aborted.reason}"))
        else:
            h.resolve(PrefillFailedError(f"unexpected {rx.kind()!r} message on a doorbell hand-off's stream"))


async def abort_call(call, reason: str, grace_s: float) -> bool:
    """Explicit abort towards the prefill worker, then drop the stream (whatever state it is in).
    No other task may be writing to the call, and its StreamReader must be discarding (else the
    call's status would wait for messages nobody reads).

    Returns whether the call had ended by itself (the prefill worker's handler returned, or its
    process or connection is gone) before this side had to cancel it."""
    # Give the prefill worker grace_s to end the call itself after the abort message; the stream
    # may already be gone, and then the cancel below is all there is to do.
    ended = call.done()
    try:
        if not ended:
            async with asyncio.timeout(grace_s):
                await call.write(kv_pb2.PrefillClientMessage(abort=kv_pb2.PrefillAbort(reason=reason)))
                await call.done_writing()
                await call.code()
                ended = True  # not call.done(): the timeout's cancel also marks the call done
    except grpc.aio.AioRpcError:
        ended = True  # the call already carries its final status
    except (Exception, asyncio.CancelledError):  # noqa: BLE001 - timed out, or the stream is unusable
        ended = False
    call.cancel()
    return ended
