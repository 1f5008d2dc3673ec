"""audit: a gateway hook that appends one JSON line per request and answer to the file named by
$KVRELAY_AUDIT_LOG (nothing when unset), refuses requests whose `user` is "blocked" (403),
and redacts the word "secret" from non-streamed answers' text."""

from __future__ import annotations

import json
import os

from kvrelay.gateway.hooks import Reject


class AuditHook:
    def __init__(self):
        self.path = os.environ.get("KVRELAY_AUDIT_LOG")

    def _log(self, record: dict) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")

    def on_request(self, path: str, body: dict):
        self._log({"event": "request", "path": path, "user": body.get("user"), "model": body.get("model")})
        if body.get("user") == "blocked":
            raise Reject(403, "user 'blocked' may not use this gateway", "user_blocked")
        if body.get("user") == "hook-bug":  # lets the example's test show a failing hook's 500
            raise RuntimeError("a bug in the hook")

    def on_response(self, path: str, status: int, body: dict):
        self._log({"event": "response", "path": path, "status": status, "id": body.get("id")})
        for choice in body.get("choices", []):
            if isinstance(choice.get("text"), str):
                choice["text"] = choice["text"].replace("secret", "[redacted]")
            message = choice.get("message")
            if isinstance(message, dict) and isinstance(message.get("content"), str):
                message["content"] = message["content"].replace("secret", "[redacted]")
        return body
