"""CPU the gateway's API process spends per streamed request and per streamed chunk, in-process.

The engine runs in an engine-core process of its own, as `kvrelay serve` runs it, so this
process's CPU time (time.process_time: every thread, the tokenizer pool included) is the
gateway's work plus the engine client's. The gateway path calls the ASGI app directly (the
app `kvrelay serve` builds, with a tenants file, so auth and the in-memory quota run), with no
HTTP server or socket: one POST /v1/completions (or /v1/chat/completions) with stream=true at a
time, its events collected, alternating with the direct path. The direct path calls the engine client's `generate` with the same
prompt and parameters. Gateway minus direct is the API process's own CPU:

  per request   (gateway - direct) at max_tokens 1
  per chunk     ((gateway - direct) at max_tokens N+1 minus the same at max_tokens 1) / N

Figures are CPU microseconds, not latency; a shared machine makes them noisy (take the median of
several --rounds). --profile prints a cProfile of the gateway path instead.

    .venv/bin/python benchmarks/gateway_cpu.py [--requests 200] [--tokens 32] [--rounds 3] [--chat] [--profile]
        [--loop auto|asyncio]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gateway import PROMPT, loop_name, run_on_loop, write_tenants


def http_scope(path: str, body: bytes) -> dict:
    headers = [(b"host", b"127.0.0.1"), (b"user-agent", b"bench"), (b"accept", b"*/*"),
               (b"content-type", b"application/json"), (b"authorization", b"Bearer bench-key"),
               (b"content-length", str(len(body)).encode())]
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": headers, "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000),
            "state": {}}


async def call_app(app, path: str, body: bytes) -> list[dict]:
    """One request through the ASGI app; returns the messages it sent."""
    sent: list[dict] = []
    delivered = False
    never = asyncio.Event()

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await never.wait()  # the client stays connected

    async def send(message):
        sent.append(message)

    await app(http_scope(path, body), receive, send)
    return sent


def request_body(chat: bool, max_tokens: int) -> tuple[str, bytes]:
    common = {"model": "", "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True}
    if chat:
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": PROMPT}]}
    return "/v1/completions", {**common, "prompt": PROMPT}


async def measure(gateway, app, chat: bool, requests: int, max_tokens: int) -> tuple[float, float, int]:
    """CPU seconds per request on the gateway path and on the direct path, and chunks per gateway request."""
    from kvrelay.engine.sampling_params import SamplingParams

    path, body = request_body(chat, max_tokens)
    body["model"] = gateway.backend.model_name
    raw = json.dumps(body).encode()
    engine = gateway.backend.engine
    # The direct path gets the gateway's own token ids (the chat template rendered), so the engine's
    # work and the client's messages are the same on both paths.
    prepared = await (gateway.prepare_chat if chat else gateway.prepare_completion)(
        *_parsed(chat, body), gateway.tenants.authenticate("bench-key"))
    prompt = prepared.prompts[0]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = iter(range(10**9))

    async def direct():
        async for _ in engine.generate(prompt, params, f"direct-{next(ids)}"):
            pass

    for _ in range(5):  # warm-up
        await call_app(app, path, raw)
        await direct()
    via = own = 0.0
    chunks = 0
    for _ in range(requests):  # alternating, so both paths see the same machine
        t0 = time.process_time()
        sent = await call_app(app, path, raw)
        t1 = time.process_time()
        await direct()
        via, own = via + t1 - t0, own + time.process_time() - t1
        chunks += sum(1 for m in sent if m["type"] == "http.response.body")
    return via / requests, own / requests, chunks // requests


def _parsed(chat: bool, body: dict):
    from kvrelay.gateway.schemas import ChatCompletionRequest, CompletionRequest

    return ((ChatCompletionRequest if chat else CompletionRequest).model_validate(body),)


async def main(args) -> None:
    from kvrelay.engine.core.client import EngineProcess
    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.gateway.app import Gateway, create_app
    from kvrelay.gateway.backend import LocalBackend
    from kvrelay.gateway.quota import MemoryQuotaStore, QuotaManager
    from kvrelay.gateway.tenants import TenantRegistry

    with tempfile.TemporaryDirectory() as folder:
        process = EngineProcess.start(EngineArgs(), "warning")
        gateway = Gateway(LocalBackend(EngineArgs(), process), TenantRegistry(write_tenants(folder)),
                          QuotaManager(MemoryQuotaStore()))
        app = create_app(gateway)
        await gateway.start()
        try:
            if args.profile:
                await profile(gateway, app, args)
                return
            rows = []
            for _ in range(args.rounds):
                one = await measure(gateway, app, args.chat, args.requests, 1)
                many = await measure(gateway, app, args.chat, args.requests, args.tokens + 1)
                per_request = one[0] - one[1]
                per_chunk = ((many[0] - many[1]) - per_request) / args.tokens
                rows.append((per_request, per_chunk))
                print(f"round: gateway {one[0] * 1e6:.0f} us, direct {one[1] * 1e6:.0f} us per 1-token request; "
                      f"gateway {many[0] * 1e6:.0f} us, direct {many[1] * 1e6:.0f} us per {args.tokens + 1}-token "
                      f"request ({many[2]} body messages); added: {per_request * 1e6:.0f} us per request, "
                      f"{per_chunk * 1e6:.1f} us per chunk", flush=True)
            route = "chat" if args.chat else "completions"
            print(f"{route}, median of {args.rounds} rounds of {args.requests} requests: "
                  f"{statistics.median(r[0] for r in rows) * 1e6:.0f} us CPU per request, "
                  f"{statistics.median(r[1] for r in rows) * 1e6:.1f} us CPU per chunk")
        finally:
            await gateway.shutdown()


async def profile(gateway, app, args) -> None:
    import cProfile
    import pstats

    path, body = request_body(args.chat, args.tokens + 1)
    body["model"] = gateway.backend.model_name
    raw = json.dumps(body).encode()
    for _ in range(5):
        await call_app(app, path, raw)
    prof = cProfile.Profile(time.thread_time)  # CPU of the event loop thread, not waits
    prof.enable()
    for _ in range(args.requests):
        await call_app(app, path, raw)
    prof.disable()
    pstats.Stats(prof).sort_stats(os.environ.get("SORT", "tottime")).print_stats(int(os.environ.get("TOP", "40")))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200, help="requests per path and round")
    parser.add_argument("--tokens", type=int, default=32, help="N: the chunks the per-chunk figure is over")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--chat", action="store_true", help="/v1/chat/completions instead of /v1/completions")
    parser.add_argument("--profile", action="store_true", help="cProfile the gateway path (tottime, top 40)")
    parser.add_argument("--loop", choices=["auto", "asyncio"], default="auto",
                        help="auto: uvloop when installed, as `kvrelay serve` runs; asyncio: the standard library's")
    args = parser.parse_args()
    print(f"event loop: {loop_name(args.loop)}")
    run_on_loop(main(args), args.loop)
