"""Errors <-> gRPC status, both ways, so the gateway sees the engine's own exception types
(InvalidRequestError with its field, PromptTooLongError with its limit) across the wire."""

from __future__ import annotations

import grpc
from kvrelay.engine.block_pool import NoFreeBlocksError
from kvrelay.engine.errors import EngineDeadError, InvalidRequestError, PromptTooLongError
from kvrelay.kvtransfer import errors as E

_BY_NAME = {cls.__name__: cls for cls in (
    E.HandoffError, E.LayoutMismatchError, E.ChunkError, E.PrefillFailedError, E.NoCapacityError,
    E.WorkerUnavailableError, E.RequestAbortedError, E.DeadlineExceededError)}
_BY_CODE = {
    grpc.StatusCode.FAILED_PRECONDITION: E.LayoutMismatchError,
    grpc.StatusCode.DATA_LOSS: E.ChunkError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: E.NoCapacityError,
    grpc.StatusCode.UNAVAILABLE: E.WorkerUnavailableError,
    grpc.StatusCode.CANCELLED: E.RequestAbortedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: E.DeadlineExceededError,
}


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, tuple[tuple[str, str], ...]]:
    """(code, trailing metadata) describing exc."""
    md = [("kvrelay-error", type(exc).__name__)]
    if isinstance(exc, InvalidRequestError):
        if exc.field:
            md.append(("kvrelay-field", exc.field))
        if isinstance(exc, PromptTooLongError):
            md += [("kvrelay-num-tokens", str(exc.num_tokens)), ("kvrelay-limit", str(exc.limit))]
        return grpc.StatusCode.INVALID_ARGUMENT, tuple(md)
    if isinstance(exc, NoFreeBlocksError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, tuple(md)
    if isinstance(exc, EngineDeadError):
        return grpc.StatusCode.UNAVAILABLE, tuple(md)
    if isinstance(exc, E.HandoffError):
        return exc.code, tuple(md)
    return grpc.StatusCode.INTERNAL, tuple(md)


async def abort_with(context, exc: BaseException) -> None:
    code, md = status_of(exc)
    context.set_trailing_metadata(md)
    await context.abort(code, str(exc))


def error_from_rpc(e: grpc.aio.AioRpcError, addr: str) -> Exception:
    """The exception a client raises for a failed call to the worker at addr."""
    md = {k: v for k, v in (e.trailing_metadata() or ())}
    name = md.get("kvrelay-error")
    details = e.details() or e.code().name
    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
        if name == "PromptTooLongError":
            return PromptTooLongError(details, int(md.get("kvrelay-num-tokens", 0)), int(md.get("kvrelay-limit", 0)),
                                      field=md.get("kvrelay-field", "prompt"))
        return InvalidRequestError(details, field=md.get("kvrelay-field"))
    cls = _BY_NAME.get(name) or _BY_CODE.get(e.code(), E.HandoffError)
    if e.code() == grpc.StatusCode.UNAVAILABLE and name is None:
        details = f"worker {addr} unreachable: {details}"
    return cls(details)
