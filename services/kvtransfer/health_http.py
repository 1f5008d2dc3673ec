"""A worker's HTTP port (`--metrics-port`): Prometheus `/metrics`, and `/health` (liveness) and
`/ready` (readiness) for Kubernetes probes, both 503 while the step-loop watchdog finds the
engine hung; `/ready` also while the worker drains."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def serve_health(port: int, host: str, registry: CollectorRegistry, alive: Callable[[], str | None],
                 ready: Callable[[], str | None]) -> ThreadingHTTPServer:
    """Serve on its own thread; returns the server (call .shutdown()). alive/ready return None when
    fine, else the reason shown with the 503."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, generate_latest(registry), CONTENT_TYPE_LATEST)
            elif path in ("/health", "/ready"):
                problem = alive() if path == "/health" else ready()
                body = {"status": "ok"} if problem is None else {"status": "unhealthy", "reason": problem}
                self._send(200 if problem is None else 503, json.dumps(body).encode(), "application/json")
            else:
                self._send(404, b"not found\n", "text/plain")

        def _send(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args) -> None:
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="kvrelay-health", daemon=True).start()
    return server
