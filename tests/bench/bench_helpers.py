"""Helpers of the bench tests: a small real OpenAI-style streaming server that misbehaves on cue,
and running `kvrelay bench` in this process.

The fake server answers /v1/completions by the prompt's text: "ok" streams max_tokens increments,
"error500" answers 500, "ratelimit-once-N" answers 429 (Retry-After) on its first attempt only,
"ratelimit-always" answers 429 every time, "drop" breaks the connection mid-stream, "incomplete"
ends the stream without [DONE], "stream-error" sends an error event. Its /metrics reports an RSS
that grows by `leak_bytes` per request served (0: steady), like a leaking server would.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

ALICE_KEY, BOB_KEY = "alice-key", "bob-key"  # the tenants of the `kvrelay serve` fixture
BOB_RPM = 3  # bob's requests per minute: his 4th request in a minute gets a 429


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class FakeState:
    leak_bytes: int = 0
    base_rss: int = 100 * 2**20
    served: int = 0
    retry_after: str = "0.2"
    attempts: dict = field(default_factory=dict)
    expose_metrics: bool = True


def _chunk(text: str) -> bytes:
    return (
        b"data: "
        + json.dumps(
            {"object": "text_completion", "choices": [{"index": 0, "text": text, "finish_reason": None}]}
        ).encode()
        + b"\n\n"
    )


def make_app(state: FakeState) -> Starlette:
    async def completions(request: Request):
        body = await request.json()
        prompt = body.get("prompt", "")
        n = int(body.get("max_tokens") or 4)
        state.served += 1
        state.attempts[prompt] = state.attempts.get(prompt, 0) + 1
        if prompt == "error500":
            return JSONResponse({"error": {"message": "boom", "type": "server_error"}}, status_code=500)
        if prompt == "ratelimit-always" or (
            prompt.startswith("ratelimit-once") and state.attempts[prompt] == 1
        ):
            return JSONResponse(
                {"error": {"message": "slow down"}},
                status_code=429,
                headers={"Retry-After": state.retry_after},
            )

        async def events():
            for i in range(n):
                if prompt == "drop" and i == 2:
                    raise ConnectionResetError("dropped on purpose")  # uvicorn aborts the response
                if prompt == "stream-error" and i == 2:
                    yield b'data: {"error": {"message": "engine died", "code": 500}}\n\n'
                    yield b"data: [DONE]\n\n"
                    return
                yield _chunk("x ")
                await asyncio.sleep(0.002)
            if prompt == "incomplete":
                return
            yield (
                b"data: "
                + json.dumps(
                    {
                        "choices": [],
                        "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n},
                    }
                ).encode()
                + b"\n\n"
            )
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def metrics(request: Request):
        if not state.expose_metrics:
            return PlainTextResponse("not found", status_code=404)
        rss = state.base_rss + state.served * state.leak_bytes
        return PlainTextResponse(
            f"# TYPE process_resident_memory_bytes gauge\nprocess_resident_memory_bytes {rss}\n"
        )

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models),
            Route("/metrics", metrics),
        ]
    )


class FakeServer:
    """The fake app on uvicorn, in a thread, on a free loopback port."""

    def __init__(self, state: FakeState | None = None):
        import uvicorn

        self.state = state or FakeState()
        self.port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(
                make_app(self.state), host="127.0.0.1", port=self.port, log_level="critical", access_log=False
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("fake server did not start")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def bench(*argv: str) -> int:
    """`kvrelay bench ...` in this process; its exit code."""
    from kvrelay.cli import main

    return main(["bench", *argv])


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


def write_jsonl(path, records: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def metric_sum(url: str, name: str) -> float:
    """A series' value summed over its labels from a /metrics page (0 when absent)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    # The API port's /metrics wants a tenant's key when the server has a tenants file.
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {ALICE_KEY}"}, timeout=5).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def max_overlap(requests: list[dict]) -> int:
    """Most requests in flight at once, from their recorded start and end."""
    events = sorted(
        [(r["start"], 1) for r in requests] + [(r["start"] + r["e2e"], -1) for r in requests],
        key=lambda e: (e[0], e[1]),
    )
    best = cur = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best
