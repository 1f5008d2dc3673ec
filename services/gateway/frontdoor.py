"""The unauthenticated surface: limits that hold before any handler runs.

uvicorn serves HTTP/1.1 with h11 (not httptools, which buffers headers without a bound),
with these limits on top:

- header bytes: h11's `max_incomplete_event_size` refuses a request head larger than
  `max_header_bytes` (a 100 MB header costs the gateway at most that much);
- header count: `HeaderCountLimit` answers 431 past `max_headers`;
- header-read timeout: a connection must deliver a complete request head within
  `header_timeout_s` of opening (or of its previous response), else it is closed, so
  half-open connections cannot be held;
- connections per client address: past `max_connections_per_client` a new connection is
  closed at once (0: no limit; behind a proxy every client shares the proxy's address).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

import h11
from kvrelay.gateway import errors
from uvicorn.protocols.http.h11_impl import H11Protocol


@dataclass(frozen=True)
class FrontDoorLimits:
    max_header_bytes: int = 32 * 1024
    max_headers: int = 100
    header_timeout_s: float = 10.0
    max_connections_per_client: int = 256


class _GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the header-read timeout and the per-address connection limit."""

    limits: FrontDoorLimits = FrontDoorLimits()
    open_per_client: Counter[str]  # shared by every connection of one server

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._counted: str | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        host = self.client[0] if self.client else None
        cap = self.limits.max_connections_per_client
        if host is not None and cap > 0:
            if self.open_per_client[host] >= cap:
                transport.close()
                return
            self.open_per_client[host] += 1
            self._counted = host
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._cancel_head_timer()
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timeout)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the request head is complete
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_head_timer()  # the next request's head is timed too (keep-alive)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        if self._counted is not None:
            self.open_per_client[self._counted] -= 1
            if self.open_per_client[self._counted] <= 0:
                del self.open_per_client[self._counted]
            self._counted = None
        super().connection_lost(exc)


def uvicorn_options(limits: FrontDoorLimits) -> dict:
    """Keyword arguments for `uvicorn.Config` that apply `limits`."""
    protocol = type("GuardedH11Protocol", (_GuardedH11Protocol,), {"limits": limits, "open_per_client": Counter()})
    return {"http": protocol, "h11_max_incomplete_event_size": limits.max_header_bytes}


class HeaderCountLimit:
    """ASGI middleware: a request with more than `max_headers` header lines gets a 431."""

    def __init__(self, app, max_headers: int):
        self.app = app
        self.max_headers = max_headers

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and len(scope.get("headers") or ()) > self.max_headers:
            err = errors.ApiError(431, f"More than {self.max_headers} request headers", code="too_many_headers")
            return await err.response()(scope, receive, send)
        return await self.app(scope, receive, send)
