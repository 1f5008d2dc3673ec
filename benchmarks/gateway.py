"""Latency the gateway adds (auth + quota + queue + HTTP/SSE proxy) over calling the engine directly.

One gateway (uvicorn + in-process engine, with a tenants file so the API key check and the
quota reservation run: in-memory store, or Redis with --redis-url) serves in this process.
Requests arrive at a fixed rate (open loop: one every 1/rate s, whatever the previous ones
are doing) and alternate between two paths onto the SAME engine, so both see the same
engine load and CPU contention:

  direct   AsyncEngine.generate() on the gateway's engine, no HTTP, issued in this process;
  gateway  POST /v1/completions with stream=true over loopback HTTP/SSE, timed by the client of
           `kvrelay bench` (kvrelay.bench.client: httpx, keep-alive connections) in a child
           process (a real client never shares the gateway's process; in-process, the client's
           own socket reads ran on the gateway's event loop and held the GIL against the
           engine: --in-process-client).

With --cluster it measures the cluster role instead: a prefill worker, a decode worker and
`kvrelay gateway` run as separate processes (the bundled model), and this process is the
client of both paths:

  direct   DecodeClient.generate() over gRPC to the decode worker, prefilled on the prefill worker;
  gateway  the same request as HTTP/SSE through the gateway, which routes it to the same pair.

With --floor the HTTP server runs a bare SSE app on the same engine instead of the gateway (no auth,
quota, request parsing or OpenAI response building): the added latency of HTTP streaming alone between
two processes on this machine, the floor under the gateway's figure.

It prints p50/p99 of time to first token and end-to-end time per path (kvrelay.bench.stats: the
same percentiles as `kvrelay bench serve`), and the added latency (gateway percentile minus
direct percentile).  Target: p50 <= 3 ms and p99 <= 10 ms added.  It also prints the paired
figure: each gateway request minus the direct request issued 1/rate before it on the same engine.

    .venv/bin/python benchmarks/gateway.py [--rate 20] [--requests 1000] [--max-tokens 16] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import free_port, stop_process

from kvrelay.bench.client import ClientConfig, RequestResult, make_http_client, send
from kvrelay.bench.stats import distribution

PROMPT = "Once upon a time, there was a little girl named Lily. She"


async def open_loop(rate: float, count: int, one, start: float | None = None, parity: int | None = None) -> list:
    """Calls one(i) at start + i / rate (perf_counter is CLOCK_MONOTONIC: shared by processes);
    with parity, only for the i of that parity."""
    start = time.perf_counter() if start is None else start
    tasks = []
    for i in range(count):
        if parity is not None and i % 2 != parity:
            continue
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    return await asyncio.gather(*tasks)


def write_tenants(folder: str) -> str:
    """One tenant with (generous) quotas on every limit, so each limit's check runs."""
    import yaml
    from kvrelay.gateway.tenants import hash_key

    tenants = os.path.join(folder, "tenants.yaml")
    with open(tenants, "w") as f:
        yaml.safe_dump({"tenants": [{"id": "bench", "api_keys_sha256": [hash_key("bench-key")], "quotas": {
            "requests_per_minute": 10**9, "tokens_per_minute": 10**12, "concurrent_requests": 10**6,
            "tokens_per_day": 10**15}}]}, f)
    return tenants


def client_config(port: int) -> ClientConfig:
    return ClientConfig(base_url=f"http://127.0.0.1:{port}", model="stories260K", api_key="bench-key",
                        ignore_eos=True, max_retries_429=0)


async def stream_once(http, cfg: ClientConfig, max_tokens: int) -> tuple[float, float]:
    """(TTFT, end-to-end) of one streamed request, timed by `kvrelay bench`'s client."""
    r = RequestResult(index=0, session=0, turn=0, tenant=None, start=0.0)
    await send(http, cfg, r, PROMPT, None, max_tokens, None, time.perf_counter())
    if not r.ok:
        raise RuntimeError(f"gateway request failed: {r.error}: {r.error_detail}")
    return r.ttft, r.e2e


async def time_outputs(outputs) -> tuple[float, float]:
    """(TTFT, end-to-end) of iterating an async iterator of RequestOutput to its end."""
    t0 = time.perf_counter()
    ttft = None
    async for out in outputs:
        if ttft is None and out.new_token_ids:
            ttft = time.perf_counter() - t0
    return ttft, time.perf_counter() - t0


def bare_sse_app(backend, params):
    """--floor: the same engine and HTTP server, with none of the gateway (no auth, quota, request
    parsing or OpenAI response building): one minimal SSE event per engine output, then [DONE]."""
    import itertools

    ids = itertools.count()

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":  # the gateway's own lifespan starts the engine; here we do
            await receive()
            await backend.start()
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await backend.shutdown()
            await send({"type": "lifespan.shutdown.complete"})
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        async for out in backend.engine.generate(PROMPT, params, f"floor-{next(ids)}"):
            event = json.dumps({"choices": [{"index": 0, "text": out.text}]})
            await send({"type": "http.response.body", "body": f"data: {event}\n\n".encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    return app


async def client_process(args) -> None:
    """Child: warm up, then the gateway half (odd i) of the open-loop schedule; prints results."""
    cfg = client_config(args.client_port)
    async with make_http_client(cfg) as http:
        for _ in range(5):
            await stream_once(http, cfg, args.max_tokens)

        async def one(i: int):
            return await stream_once(http, cfg, args.max_tokens)

        print(json.dumps(await open_loop(args.rate, args.requests, one, start=args.start, parity=1)), flush=True)


async def run_interleaved(args, folder: str) -> tuple[list, list]:
    """Gateway (uvicorn in this event loop) and direct engine calls, alternating, on one engine."""
    import uvicorn
    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.engine.sampling_params import SamplingParams
    from kvrelay.gateway.app import Gateway, create_app
    from kvrelay.gateway.backend import LocalBackend
    from kvrelay.gateway.frontdoor import uvicorn_options
    from kvrelay.gateway.quota import MemoryQuotaStore, QuotaManager, RedisQuotaStore
    from kvrelay.gateway.tenants import TenantRegistry

    tenants = write_tenants(folder)
    store = RedisQuotaStore(args.redis_url) if args.redis_url else MemoryQuotaStore()
    process = None
    engine_args = EngineArgs(reserved_cpus=1)  # as `kvrelay serve` runs it: one CPU stays with the API side
    if args.engine_process:  # as `kvrelay serve` runs it; the direct path then goes through its client
        from kvrelay.engine.core.client import EngineProcess

        process = EngineProcess.start(engine_args, "warning")
    gateway = Gateway(LocalBackend(engine_args, process), TenantRegistry(tenants), QuotaManager(store))
    port = free_port()
    # The front door `kvrelay serve` uses (httptools with header limits), unless --httptools asks for uvicorn's bare default.
    http = {} if args.httptools else uvicorn_options(gateway.config.frontdoor)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    app = bare_sse_app(gateway.backend, params) if args.floor else create_app(gateway)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False, **http))
    serve = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    engine = gateway.backend.engine
    cfg = client_config(port)
    http = make_http_client(cfg)
    direct, via = [], []

    async def one_direct(i: int):
        direct.append((i, *await time_outputs(engine.generate(PROMPT, params, f"direct-{i}"))))

    async def one_gateway(i: int):
        via.append((i, *await stream_once(http, cfg, args.max_tokens)))

    async def one(i: int):
        await (one_gateway(i) if i % 2 else one_direct(i))

    if args.in_process_client:
        for i in range(10):  # warm-up
            await one(-1 - i)
        direct.clear()
        via.clear()
        await open_loop(args.rate, args.requests, one)
    else:
        start = time.perf_counter() + 4.0  # the child's start-up and warm-up fit in 4 s
        child = await asyncio.create_subprocess_exec(
            sys.executable, __file__, "--client-port", str(port), "--start", repr(start), "--rate", str(args.rate),
            "--requests", str(args.requests), "--max-tokens", str(args.max_tokens), stdout=subprocess.PIPE)
        for i in range(5):  # warm-up
            await one_direct(-1 - i)
        direct.clear()
        await open_loop(args.rate, args.requests, one_direct, start=start, parity=0)
        out, _ = await child.communicate()
        if child.returncode:
            raise RuntimeError(f"client process failed with exit code {child.returncode}")
        via = [(i, *r) for i, r in zip(range(1, args.requests, 2), json.loads(out.decode().strip().splitlines()[-1]))]
    await http.close()
    server.should_exit = True
    await serve
    if process is not None:
        process.stop()
    return direct, via


class Process:
    """A kvrelay command in its own process, started once it prints what `ready` matches (None: at once)."""

    def __init__(self, args: list[str], ready: str | None):
        import re
        import threading

        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "kvrelay.cli", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)
        self.match = None
        if ready:
            for line in self.proc.stdout:
                self.match = re.search(ready, line)
                if self.match:
                    break
            else:
                raise RuntimeError(f"`kvrelay {' '.join(args)}` exited before it was ready")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()  # keep draining

    def stop(self) -> None:
        stop_process(self.proc)


async def run_cluster(args, folder: str) -> tuple[list, list]:
    """Prefill worker, decode worker and gateway processes; this process calls the decode worker
    directly and the gateway, alternating, on the same open-loop schedule."""
    import httpx
    from kvrelay.engine.sampling_params import SamplingParams
    from kvrelay.kvtransfer.client import DecodeClient

    port = free_port()
    listening = r"listening on ([\d.]+):(\d+)"
    procs = []
    try:
        procs.append(Process(["prefill", "--host", "127.0.0.1", "--port", "0"], listening))
        prefill_addr = ":".join(procs[-1].match.groups())
        procs.append(Process(["decode", "--host", "127.0.0.1", "--port", "0"], listening))
        decode_addr = ":".join(procs[-1].match.groups())
        gateway = ["gateway", "--host", "127.0.0.1", "--port", str(port), "--prefill", prefill_addr,
                   "--decode", decode_addr, "--tenants", write_tenants(folder), "--log-level", "warning"]
        if args.redis_url:
            gateway += ["--redis-url", args.redis_url]
        procs.append(Process(gateway, None))
        async with httpx.AsyncClient() as http:
            for _ in range(300):  # the gateway is ready once it sees both workers' load streams
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get(f"http://127.0.0.1:{port}/ready")).status_code == 200:
                        break
                if procs[-1].proc.poll() is not None:
                    raise RuntimeError("the gateway exited at start-up")
                await asyncio.sleep(0.1)
            else:
                raise RuntimeError("the gateway never became ready")
        client = DecodeClient(decode_addr)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        cfg = client_config(port)
        http = make_http_client(cfg)
        direct, via = [], []

        async def one(i: int):
            if i % 2:
                via.append((i, *await stream_once(http, cfg, args.max_tokens)))
            else:
                direct.append((i, *await time_outputs(client.generate(PROMPT, params, prefill_addr=prefill_addr))))

        for i in range(10):  # warm-up
            await one(-1 - i)
        direct.clear()
        via.clear()
        await open_loop(args.rate, args.requests, one)
        await client.close()
        await http.close()
        return direct, via
    finally:
        for proc in reversed(procs):
            proc.stop()


def summary(name: str, results: list[tuple[int, float, float]]) -> dict[str, float]:
    ttft = distribution(r[1] * 1000 for r in results)
    e2e = distribution(r[2] * 1000 for r in results)
    row = {"ttft_p50": ttft["p50"], "ttft_p99": ttft["p99"], "e2e_p50": e2e["p50"], "e2e_p99": e2e["p99"]}
    print(f"{name:8s} TTFT p50 {row['ttft_p50']:7.2f} ms  p99 {row['ttft_p99']:7.2f} ms   "
          f"e2e p50 {row['e2e_p50']:7.2f} ms  p99 {row['e2e_p99']:7.2f} ms   (mean e2e {e2e['mean']:.2f})")
    return row


def loop_name(choice: str) -> str:
    """What uvicorn's loop="auto" would pick (uvloop when installed), or asyncio."""
    if choice == "auto":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            return "asyncio"
        return "uvloop"
    return "asyncio"


def run_on_loop(coro, choice: str):
    """Run coro on the event loop `kvrelay serve` would use (--loop auto) or on asyncio's."""
    if loop_name(choice) == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second")
    # 500 requests a path: over 100, the added e2e p50 (a difference of two medians) scattered 1.6-4.3 ms
    # between back-to-back runs on the idle 2-core machine.
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--redis-url", default=None, help="quota store for the gateway run (default: in-memory)")
    parser.add_argument("--httptools", action="store_true",
                        help="serve with uvicorn's bare httptools protocol instead of the gateway's front door (its limits)")
    parser.add_argument("--in-process-client", action="store_true",
                        help="read the gateway's streams from this process's event loop (the old set-up)")
    parser.add_argument("--engine-process", action="store_true",
                        help="the engine in a process of its own, as `kvrelay serve` runs it (default: in-process)")
    parser.add_argument("--cluster", action="store_true",
                        help="prefill + decode workers and `kvrelay gateway` as processes; direct = gRPC to the decode worker")
    parser.add_argument("--floor", action="store_true",
                        help="serve a bare SSE app on the same engine and HTTP server instead of the gateway: "
                             "what HTTP streaming alone adds on this machine")
    parser.add_argument("--loop", choices=["auto", "asyncio"], default="auto",
                        help="the gateway's event loop: auto is uvloop when installed, as `kvrelay serve` "
                             "(uvicorn) picks it; asyncio is the standard library's")
    parser.add_argument("--client-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--start", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client_port:
        return asyncio.run(client_process(args))
    if args.cluster:
        setup = "cluster role: prefill, decode and gateway processes, this process the client of both paths"
    else:
        where = "the gateway process" if args.in_process_client else "its own process"
        engine = "engine-core process" if args.engine_process else "in-process engine"
        app = "a bare SSE app (--floor)" if args.floor else "kvrelay serve"
        setup = f"{app} ({engine}), HTTP client in {where}"
    print(f"{args.requests} streaming requests at {args.rate}/s, {args.max_tokens} tokens each, "
          f"quota store: {'redis' if args.redis_url else 'memory'}; {setup}; loop {loop_name(args.loop)}")
    with tempfile.TemporaryDirectory() as folder:
        run = run_cluster if args.cluster else run_interleaved
        direct_results, via_results = run_on_loop(run(args, folder), args.loop)
    direct = summary("direct", direct_results)
    via = summary("gateway", via_results)
    for key in ("ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99"):
        target = {"p50": 3.0, "p99": 10.0}[key[-3:]]
        added = via[key] - direct[key]
        print(f"added {key:9s} {added:7.2f} ms  (target <= {target:.0f} ms: {'met' if added <= target else 'MISSED'})")
    # The difference of two medians moves with where each median falls in a lumpy distribution (which
    # engine steps a request shares); pairing each gateway request with the direct one issued just before
    # it (1/rate earlier, on the same engine) cancels most of that.
    by_index = {r[0]: r for r in direct_results}
    pairs = [(v, by_index[v[0] - 1]) for v in via_results if v[0] - 1 in by_index]
    for name, k in (("ttft", 1), ("e2e", 2)):
        paired = distribution((v[k] - d[k]) * 1000 for v, d in pairs)
        print(f"paired {name:4s} added p50 {paired['p50']:6.2f} ms  mean {paired['mean']:6.2f} ms  "
              f"({len(pairs)} pairs: gateway request i+1 minus direct request i)")


if __name__ == "__main__":
    main()
