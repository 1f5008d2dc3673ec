"""The unauthenticated surface: limits that hold before any handler runs.

uvicorn serves HTTP/1.1 with httptools (llhttp, in C: about 0.5 ms less added latency per
streamed request than h11 on the 2-core machine, docs/benchmarks.md), with these limits on top:

- header bytes: at most `max_header_bytes` of a request head reach the parser (which would
  buffer one header of any size); past them the answer is 431 and the connection closes, so a
  100 MB header costs the gateway at most that much;
- header count: `HeaderCountLimit` answers 431 past `max_headers`;
- header-read timeout: a connection must deliver a complete request head within
  `header_timeout_s` of opening (or of its previous response), else it is closed, so
  half-open connections cannot be held;
- connections per client address: past `max_connections_per_client` a new connection is
  closed at once (0: no limit; behind a proxy every client shares the proxy's address).
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass

from kvrelay.gateway import errors
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


@dataclass(frozen=True)
class FrontDoorLimits:
    max_header_bytes: int = 32 * 1024
    max_headers: int = 100
    header_timeout_s: float = 10.0
    max_connections_per_client: int = 256


class _GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the head-size bound, the header-read timeout and the
    per-address connection limit."""

    limits: FrontDoorLimits = FrontDoorLimits()
    open_per_client: Counter[str]  # shared by every connection of one server

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._counted: str | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._reading_head = True  # bytes now fed to the parser belong to a request head
        self._head_bytes = 0
        self._heads = 0  # request heads completed on this connection
        host = self.client[0] if self.client else None
        cap = self.limits.max_connections_per_client
        if host is not None and cap > 0:
            if self.open_per_client[host] >= cap:
                transport.close()
                return
            self.open_per_client[host] += 1
            self._counted = host
        self._arm_head_timer()

    def data_received(self, data: bytes) -> None:
        if not self._reading_head:
            super().data_received(data)
            return
        room = self.limits.max_header_bytes - self._head_bytes
        if len(data) <= room:
            self._head_bytes += len(data)
            super().data_received(data)
            return
        heads = self._heads
        super().data_received(data[:room])  # the most of a head the limit lets the parser see
        if self.transport.is_closing():
            return
        if self._heads == heads:  # no complete head within the limit
            self._refuse_head()
            return
        super().data_received(data[room:])

    def _refuse_head(self) -> None:
        error = errors.ApiError(431, f"Request head larger than {self.limits.max_header_bytes} bytes",
                                code="request_header_fields_too_large")
        body = json.dumps(error.body()).encode()
        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._heads += 1
        self._cancel_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._reading_head = True  # what follows is the next request's head
        self._head_bytes = 0

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
    protocol = type("GuardedHttpToolsProtocol", (_GuardedHttpToolsProtocol,),
                    {"limits": limits, "open_per_client": Counter()})
    return {"http": protocol}


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
