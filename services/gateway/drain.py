"""Stopping without refusing anyone: `--shutdown-delay` keeps the gateway serving for a while after
SIGTERM, so the load balancer stops sending before the listener closes.

Kubernetes removes a terminating pod from its Service's endpoints at the same time as it sends
SIGTERM; kube-proxy and ingress controllers learn of it a moment later. A server that closes its
listener at once refuses the connections of that moment. During the delay the gateway answers
every request, /ready answers 503 (`draining`), and each answer carries `Connection: close`, so
kept-alive clients reconnect through the Service to another pod. Then uvicorn's graceful shutdown
runs as without the delay (`--shutdown-timeout`). A second signal stops at once.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

import uvicorn

log = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, delay_s: float, on_drain: Callable[[], None]):
        super().__init__(config)
        self.delay_s = delay_s
        self.on_drain = on_drain  # marks the gateway draining (/ready 503, Connection: close)
        self._timer: threading.Timer | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self.delay_s > 0 and sig == signal.SIGTERM and self._timer is None and not self.should_exit:
            log.info("SIGTERM: serving %.0f s more while load balancers take this pod out (--shutdown-delay), "
                     "then draining", self.delay_s)
            self.on_drain()
            self._timer = threading.Timer(self.delay_s, super().handle_exit, (sig, None))
            self._timer.daemon = True
            self._timer.start()
            return
        if self._timer is not None:
            self._timer.cancel()
        super().handle_exit(sig, frame)


class CloseWhileDraining:
    """ASGI middleware: while draining(), responses carry `Connection: close` (the client's next
    request opens a new connection, which the Service sends to a pod that is not stopping)."""

    def __init__(self, app, draining: Callable[[], bool]):
        self.app = app
        self.draining = draining

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.draining():
            return await self.app(scope, receive, send)

        async def closing(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        return await self.app(scope, receive, closing)
