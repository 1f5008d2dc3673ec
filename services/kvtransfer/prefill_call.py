"""The decode side's helpers for its PrefillService call: reading the next message, the explicit
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


async def ack_on_stream(call) -> None:
    with contextlib.suppress(Exception):  # the call may have ended on the doorbell's ack
        await call.write(kv_pb2.PrefillClientMessage(ack=kv_pb2.PrefillAck()))
        await call.done_writing()


async def watch_stream(call, h: DoorbellHandoff) -> None:
    """A doorbell hand-off's stream: anything before the hand-off completes ends it; after that
    the prefill worker's end of the call is read and dropped."""
    try:
        while True:
            rx = await call.read()
            if rx is grpc.aio.EOF:
                h.resolve(PrefillFailedError("the prefill worker closed the hand-off stream early"))
                return
            if rx.kind() == "aborted":
                h.resolve(PrefillFailedError(f"prefill worker aborted the hand-off: {rx.msg.aborted.reason}"))
            else:
                h.resolve(PrefillFailedError(f"unexpected {rx.kind()!r} message on a doorbell hand-off's stream"))
    except grpc.aio.AioRpcError as e:
        h.resolve(e)  # pull maps it like any other stream error


async def read_message(call) -> ServerMessage:
    msg = await call.read()
    if msg is grpc.aio.EOF:
        raise PrefillFailedError("the prefill worker closed the hand-off stream early")
    return msg


async def abort_call(call, reason: str, drain: bool, grace_s: float) -> bool:
    """Explicit abort towards the prefill worker, then drop the stream (whatever state it is in).

    drain: read and drop what the prefill worker already sent (gRPC delivers the call's status
    only after its messages); False while another task still reads the call. Returns whether the
    call had ended by itself (the prefill worker's handler returned, or its process or connection
    is gone) before this side had to cancel it."""
    # Give the prefill worker grace_s to end the call itself after the abort message; the stream
    # may already be gone, and then the cancel below is all there is to do.
    ended = call.done()
    try:
        if not ended:
            async with asyncio.timeout(grace_s):
                await call.write(kv_pb2.PrefillClientMessage(abort=kv_pb2.PrefillAbort(reason=reason)))
                await call.done_writing()
                while drain and await call.read() is not grpc.aio.EOF:
                    pass
                await call.code()
                ended = True  # not call.done(): the timeout's cancel also marks the call done
    except grpc.aio.AioRpcError:
        ended = True  # the call already carries its final status
    except (Exception, asyncio.CancelledError):  # noqa: BLE001 - timed out, or the stream is unusable
        ended = False
    call.cancel()
    return ended
