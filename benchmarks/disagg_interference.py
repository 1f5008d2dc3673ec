"""What disaggregation is for: decode streams that long prompts do not stall.

A decode worker runs --streams requests decoding (short prompts, prefilled locally). Then
--prompts long prompts arrive one after another, each waited for until its first token:
  - unified: the decode worker prefills them itself, in steps shared with the running streams,
    so every stream waits for each prefill chunk;
  - disaggregated: a prefill worker in its own process (its own core) computes them and hands the
    K/V over (K/V inline on gRPC, and "shm, direct": same node, copied out of the prefill
    worker's shared cache), so the decode worker only reserves, copies and activates.
Printed per configuration: the streams' inter-token latency (ITL, client side) before the long
prompts arrive and while they do (p50, p99, max), and the long prompts' TTFT. Worker processes as
in benchmarks/disagg.py (dummy ~32M Llama, one torch thread each, prefill worker and client on
one core, decode worker on the other).

    .venv/bin/python benchmarks/disagg_interference.py [--streams 8] [--prompt-tokens 1024] [--prompts 4]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.client import DecodeClient

sys.path.insert(0, str(Path(__file__).parent))
from common import free_port
from disagg import AFTER, SHM, Worker, make_model, one_request, pin_this_process

CONFIGS = (  # name, prefill worker flags (None: unified), decode worker flags
    ("unified", None, ()),
    ("disaggregated, K/V on gRPC", AFTER, ()),
    ("disaggregated, shm direct", (*AFTER, "--kv-shared-cache"), SHM),
)
STREAM_PROMPT = 32


async def run_config(model: Path, flags, decode_flags, cores, args, prompts: list[list[int]]) -> dict:
    core_a, core_b = cores
    decode = Worker("decode", model, core_b if core_b is not None else core_a, free_port(), *decode_flags)
    prefill = Worker("prefill", model, core_a, free_port(), *flags) if flags is not None else None
    pin_this_process({core_a})  # beside the prefill worker: never on the decode worker's core
    client = DecodeClient(decode.addr)
    rng = random.Random(3)
    arrivals: list[list[float]] = [[] for _ in range(args.streams)]
    background = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)

    async def stream(k: int) -> None:
        prompt = [rng.randrange(3, 512) for _ in range(STREAM_PROMPT)]
        async for out in client.generate(prompt, background):
            if out.new_token_ids:
                arrivals[k].append(time.perf_counter())

    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    addr = [prefill.addr] if prefill else None
    tasks = []
    try:
        # Warm-up: one long prompt on this path before the streams start.
        await one_request(client, [rng.randrange(3, 512) for _ in range(args.prompt_tokens)], one, addr)
        tasks = [asyncio.create_task(stream(k)) for k in range(args.streams)]
        while min(len(a) for a in arrivals) < 5:
            await asyncio.sleep(0.05)
        quiet_from = time.perf_counter()
        await asyncio.sleep(args.quiet_s)
        busy_from = time.perf_counter()
        ttfts = [(await one_request(client, p, one, addr))[0] for p in prompts]
        busy_to = time.perf_counter()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
        decode.stop()
        if prefill:
            prefill.stop()
    return {"quiet": _itls(arrivals, quiet_from, busy_from), "busy": _itls(arrivals, busy_from, busy_to),
            "ttft": statistics.median(ttfts)}


def _itls(arrivals: list[list[float]], start: float, end: float) -> list[float]:
    """Every stream's gaps between tokens that arrived in [start, end)."""
    return [b - a for ts in arrivals for a, b in itertools.pairwise(ts) if start <= b < end]


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--quiet-s", type=float, default=2.0, help="seconds of streams alone, before the prompts")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    cores = (cpus[0], cpus[1] if len(cpus) > 1 else None)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    print(f"{args.streams} streams decoding on the decode worker (core {cores[1]}); {args.prompts} prompts of "
          f"{args.prompt_tokens} tokens one after another; prefill worker and this client on core {cores[0]}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp))
        for name, flags, decode_flags in CONFIGS:
            r = results[name] = await run_config(model, flags, decode_flags, cores, args, prompts)
            q, b = r["quiet"], r["busy"]
            print(f"  {name:<28} ITL alone p50 {_pct(q, 0.5) * 1e3:6.1f} p99 {_pct(q, 0.99) * 1e3:6.1f} ms | "
                  f"with the prompts p50 {_pct(b, 0.5) * 1e3:6.1f} p99 {_pct(b, 0.99) * 1e3:7.1f} max "
                  f"{max(b) * 1e3:7.1f} ms | prompt TTFT {r['ttft'] * 1e3:7.1f} ms", flush=True)
    base = results["unified"]
    for name, r in results.items():
        if name != "unified":
            print(f"  {name}: stream ITL p99 while the prompts arrive {_pct(r['busy'], 0.99) / _pct(base['busy'], 0.99):.2f}x "
                  f"unified's, prompt TTFT {r['ttft'] / base['ttft']:.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
