"""One access line per API request, and the request id that follows it to the workers.

A client's `X-Request-Id` (up to 128 characters of `A-Za-z0-9._:-`) is honoured, else one is made;
it is returned in the response's `x-request-id` header, set in `REQUEST_ID` for the request's
context (the disaggregated backend sends it to the decode worker as gRPC metadata, which logs it
and passes it to the prefill worker), and logged on the access line:

    request_id=... tenant=acme model=... method=POST path=/v1/completions status=200 prompt_tokens=12
    completion_tokens=16 queue_s=0.000 ttft_s=0.012 duration_s=0.120

Never a prompt, never a key: the line is built from the fields below only. Probes and scrapes
(/health, /ready, /metrics) are not logged.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from contextvars import ContextVar

log = logging.getLogger("kvrelay.access")

REQUEST_ID: ContextVar[str | None] = ContextVar("kvrelay_request_id", default=None)
ACCESS_STATE = "kvrelay_access"  # key in the ASGI scope's state: fields the handlers fill in
QUIET_PATHS = ("/health", "/ready", "/metrics")
_VALID_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    for name, value in headers:
        if name == b"x-request-id":
            text = value.decode("latin-1").strip()
            if _VALID_ID.fullmatch(text):
                return text
    return uuid.uuid4().hex


def access_fields(scope) -> dict:
    """The dict a handler fills with tenant, model, tokens and timings for this request's line."""
    return scope.setdefault("state", {}).setdefault(ACCESS_STATE, {})


class AccessLog:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = request_id_from(scope.get("headers", []))
        token = REQUEST_ID.set(rid)
        fields = access_fields(scope)
        status = [0]
        start = time.monotonic()

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)
            if scope.get("path") not in QUIET_PATHS:
                line = {"request_id": rid, "tenant": fields.get("tenant", "-"), "model": fields.get("model", "-"),
                        "method": scope.get("method"), "path": scope.get("path"), "status": status[0] or 499,
                        "prompt_tokens": fields.get("prompt_tokens", 0),
                        "completion_tokens": fields.get("completion_tokens", 0),
                        "queue_s": _round(fields.get("queue_s")), "ttft_s": _round(fields.get("ttft_s")),
                        "duration_s": _round(time.monotonic() - start)}
                log.info(" ".join(f"{k}={'-' if v is None else v}" for k, v in line.items()),
                         extra={"fields": line})


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
