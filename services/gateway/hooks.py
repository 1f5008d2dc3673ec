"""Gateway hooks from plugins (entry-point group kvrelay.gateway_hooks): audit logging,
redaction, policy checks, without editing the gateway.

A hook is a class, instantiated once with no arguments, with either or both of (sync or async):
- `on_request(path: str, body: dict) -> dict | None`: sees every completions / chat request's
  JSON body before validation; returns a replacement body, or None to keep it; raises
  `Reject(status, message)` to answer with that 4xx instead;
- `on_response(path: str, status: int, body: dict) -> dict | None`: sees every non-streamed
  JSON answer of those routes (errors included); returns a replacement, or None. Streamed
  (`text/event-stream`) answers pass unchanged.

A hook cannot crash the server: any other exception answers that one request with a 500
(`code: hook_error`), is logged, and is counted in kvrelay:gateway_hook_errors{hook}.
Hooks run in entry-point name order.
"""

from __future__ import annotations

import inspect
import json
import logging
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger(__name__)

GROUP = "kvrelay.gateway_hooks"
HOOKED_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class Reject(Exception):
    """Raised by a request hook: answer with this status (4xx) and message instead."""

    status: int
    message: str
    code: str = "rejected_by_hook"

    def __post_init__(self):
        if not 400 <= self.status < 500:
            raise ValueError(f"a hook rejects with a 4xx status, not {self.status}")


async def _call(fn, *args):
    out = fn(*args)
    return await out if inspect.isawaitable(out) else out


def _error(status: int, message: str, type_: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


class HookMiddleware:
    """Pure ASGI middleware running the hooks around the generation routes."""

    def __init__(self, app, hooks: list[tuple[str, object]], registry: CollectorRegistry,
                 max_body_bytes: int = 2 * 1024 * 1024):
        self.app = app
        self.hooks = hooks
        self.max_body_bytes = max_body_bytes
        self.errors = Counter("kvrelay:gateway_hook_errors", "Requests answered 500 because a gateway hook raised",
                              ["hook"], registry=registry)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in HOOKED_PATHS:
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more and size <= self.max_body_bytes:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
        raw = b"".join(chunks)
        try:
            body = json.loads(raw) if not more else None
        except ValueError:
            body = None
        if not isinstance(body, dict):  # too large or not JSON: the gateway's own checks answer it
            return await self.app(scope, _replay(raw, more, receive), send)
        path = scope["path"]
        current = "?"
        try:
            for current, hook in self.hooks:
                if hasattr(hook, "on_request"):
                    body = await _call(hook.on_request, path, body) or body
        except Reject as r:
            return await _answer(send, r.status, _error(r.status, r.message, "invalid_request_error", r.code))
        except Exception:  # noqa: BLE001 - a hook cannot crash the server
            return await self._failed(send, current)
        raw = json.dumps(body).encode()
        scope = dict(scope, headers=[(k, v) for k, v in scope["headers"] if k != b"content-length"]
                     + [(b"content-length", str(len(raw)).encode())])
        if not any(hasattr(h, "on_response") for _, h in self.hooks):
            return await self.app(scope, _replay(raw, False, receive), send)
        await self.app(scope, _replay(raw, False, receive), _ResponseHooks(self, path, send))

    async def _failed(self, send, hook_name: str, started: bool = False) -> None:
        log.exception("gateway hook %s failed", hook_name)
        self.errors.labels(hook_name).inc()
        if not started:
            await _answer(send, 500, _error(500, f"Gateway hook {hook_name!r} failed", "server_error", "hook_error"))


class _ResponseHooks:
    """An ASGI send that holds a JSON answer until its end, runs the response hooks on it, then sends it."""

    def __init__(self, mw: HookMiddleware, path: str, send):
        self.mw, self.path, self.send = mw, path, send
        self.start: dict | None = None
        self.parts: list[bytes] = []
        self.passthrough = False

    async def __call__(self, message):
        if self.passthrough:
            return await self.send(message)
        if message["type"] == "http.response.start":
            headers = dict(message.get("headers", []))
            if not headers.get(b"content-type", b"").startswith(b"application/json"):
                self.passthrough = True  # streamed events
                return await self.send(message)
            self.start = message
            return None
        self.parts.append(message.get("body", b""))
        if message.get("more_body", False):
            return None
        status, raw = self.start["status"], b"".join(self.parts)
        current = "?"
        try:
            body = json.loads(raw)
            for current, hook in self.mw.hooks:
                if hasattr(hook, "on_response"):
                    body = await _call(hook.on_response, self.path, status, body) or body
            raw = json.dumps(body).encode()
        except Exception:  # noqa: BLE001 - a hook cannot crash the server
            return await self.mw._failed(self.send, current)
        headers = [(k, v) for k, v in self.start.get("headers", []) if k != b"content-length"]
        await self.send(dict(self.start, headers=headers + [(b"content-length", str(len(raw)).encode())]))
        await self.send({"type": "http.response.body", "body": raw})


def _replay(raw: bytes, more: bool, receive):
    """A receive that yields raw first (more: the rest of the body follows from receive), then
    hands over to receive, which the app also watches for the client going away."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": more}
        return await receive()

    return replay


async def _answer(send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def install(app, registry: CollectorRegistry, max_body_bytes: int) -> list[str]:
    """Wrap app with the loaded hook plugins (none loaded: nothing changes); returns their names."""
    from kvrelay.plugins import load_plugins

    plugins = load_plugins()[GROUP]  # loaded at start already (kvrelay.cli); else from $KVRELAY_PLUGINS
    if not plugins:
        return []
    hooks = [(name, plugins[name].value()) for name in sorted(plugins)]
    app.add_middleware(HookMiddleware, hooks=hooks, registry=registry, max_body_bytes=max_body_bytes)
    return [name for name, _ in hooks]
