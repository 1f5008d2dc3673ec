"""Latency the gateway adds (auth + quota + queue + HTTP/SSE proxy) over calling the engine directly.

One gateway (uvicorn + in-process engine, with a tenants file so the API key check and the
quota reservation run: in-memory store, or Redis with --redis-url) serves in this process.
Requests arrive at a fixed rate (open loop: one every 1/rate s, whatever the previous ones
are doing) and alternate between two paths onto the SAME engine, so both see the same
engine load and CPU contention:

  direct   AsyncEngine.generate() on the gateway's engine, no HTTP;
  gateway  POST /v1/completions with stream=true over loopback HTTP/SSE, one connection per
           request, read by a minimal raw-socket client (so client-library parsing is not
           billed to the gateway).

It prints p50/p99 of time to first token and end-to-end time per path, and the added
latency (gateway percentile minus direct percentile).  Target: p50 <= 3 ms and p99 <= 10 ms added.

    .venv/bin/python benchmarks/gateway.py [--rate 20] [--requests 200] [--max-tokens 16] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import tempfile
import time

import yaml
from kvrelay.engine.engine_args import EngineArgs
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.gateway.tenants import hash_key

PROMPT = "Once upon a time, there was a little girl named Lily. She"


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


async def open_loop(rate: float, count: int, one) -> list[tuple[float, float]]:
    start = time.perf_counter()
    tasks = []
    for i in range(count):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    return await asyncio.gather(*tasks)


def write_tenants(folder: str) -> str:
    """One tenant with (generous) quotas on every limit, so each limit's check runs."""
    tenants = os.path.join(folder, "tenants.yaml")
    with open(tenants, "w") as f:
        yaml.safe_dump({"tenants": [{"id": "bench", "api_keys_sha256": [hash_key("bench-key")], "quotas": {
            "requests_per_minute": 10**9, "tokens_per_minute": 10**12, "concurrent_requests": 10**6,
            "tokens_per_day": 10**15}}]}, f)
    return tenants


async def run_interleaved(args, folder: str) -> tuple[list, list]:
    """Gateway (uvicorn in this event loop) and direct engine calls, alternating, on one engine."""
    import uvicorn
    from kvrelay.gateway.app import Gateway, create_app
    from kvrelay.gateway.backend import LocalBackend
    from kvrelay.gateway.quota import MemoryQuotaStore, QuotaManager, RedisQuotaStore
    from kvrelay.gateway.tenants import TenantRegistry

    tenants = write_tenants(folder)
    store = RedisQuotaStore(args.redis_url) if args.redis_url else MemoryQuotaStore()
    gateway = Gateway(LocalBackend(EngineArgs()), TenantRegistry(tenants), QuotaManager(store))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(gateway), host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False))
    serve = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    engine = gateway.backend.engine
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    body = {"model": "stories260K", "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    payload = json.dumps(body).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer bench-key\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
               ).encode() + payload
    direct, via = [], []

    async def one_direct(i: int):
        t0 = time.perf_counter()
        ttft = None
        async for out in engine.generate(PROMPT, params, f"direct-{i}"):
            if ttft is None and out.new_token_ids:
                ttft = time.perf_counter() - t0
        direct.append((ttft, time.perf_counter() - t0))

    async def one_gateway(i: int):
        # A minimal HTTP/1.1 client on a raw connection: httpx's own parsing would otherwise be
        # billed to the gateway. The first `data: {` event carries the first token.
        t0 = time.perf_counter()
        ttft = None
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        buffered = b""
        while True:
            data = await reader.read(65536)
            if not data:
                raise RuntimeError(f"gateway closed the stream early: {buffered[:300]!r}")
            if ttft is None and b"data: {" in data:
                ttft = time.perf_counter() - t0
            buffered = buffered[-16:] + data
            if b"data: [DONE]" in buffered:
                break
        via.append((ttft, time.perf_counter() - t0))
        writer.close()

    async def one(i: int):
        await (one_gateway(i) if i % 2 else one_direct(i))

    for i in range(10):  # warm-up
        await one(-1 - i)
    direct.clear()
    via.clear()
    await open_loop(args.rate, args.requests, one)
    server.should_exit = True
    await serve
    return direct, via


def summary(name: str, results: list[tuple[float, float]]) -> dict[str, float]:
    ttft = [r[0] * 1000 for r in results]
    e2e = [r[1] * 1000 for r in results]
    row = {"ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "e2e_p50": pct(e2e, 50), "e2e_p99": pct(e2e, 99)}
    print(f"{name:8s} TTFT p50 {row['ttft_p50']:7.2f} ms  p99 {row['ttft_p99']:7.2f} ms   "
          f"e2e p50 {row['e2e_p50']:7.2f} ms  p99 {row['e2e_p99']:7.2f} ms   (mean e2e {statistics.mean(e2e):.2f})")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--redis-url", default=None, help="quota store for the gateway run (default: in-memory)")
    args = parser.parse_args()
    print(f"{args.requests} streaming requests at {args.rate}/s, {args.max_tokens} tokens each, "
          f"quota store: {'redis' if args.redis_url else 'memory'}")
    with tempfile.TemporaryDirectory() as folder:
        direct_results, via_results = asyncio.run(run_interleaved(args, folder))
    direct = summary("direct", direct_results)
    via = summary("gateway", via_results)
    for key in ("ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99"):
        target = {"p50": 3.0, "p99": 10.0}[key[-3:]]
        added = via[key] - direct[key]
        print(f"added {key:9s} {added:7.2f} ms  (target <= {target:.0f} ms: {'met' if added <= target else 'MISSED'})")


if __name__ == "__main__":
    main()
