"""A conversation's second turn through prefill + decode workers: what the decode worker's own
prefix cache saves in the hand-off.

Turn 1 is a fresh prompt; turn 2 is turn 1, its answer and a new message. The decode worker that
generated the answer holds all of turn 2 but the new message, so its hand-off moves only the
blocks after that (PrefillStart.num_cached_blocks). The baseline is the same pair with prefix
caching off on the decode worker (`--no-prefix-caching`), which moves the whole prompt. Workers
as in benchmarks/disagg.py (dummy ~32M Llama, one pinned core each, K/V inline on gRPC). Prints,
for turn 2: KV bytes moved, the hand-off's seconds on the prefill worker's clock, client TTFT.

    .venv/bin/python benchmarks/pd_follow_up.py [--turn1 2048] [--answer 32] [--message 64] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from common import free_port
from disagg import AFTER, Worker, make_model, pin_this_process
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.client import DecodeClient


async def turn(client: DecodeClient, prompt: list[int], max_tokens: int, prefill: str) -> tuple[list[int], float]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0, ttft, tokens = time.perf_counter(), None, []
    async for out in client.generate(prompt, params, prefill_addr=prefill):
        if out.new_token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        tokens += out.new_token_ids
    return tokens, ttft


async def run(model: Path, decode_flags: tuple[str, ...], cores: list[int], args, rng_seed: int) -> dict[str, float]:
    decode = Worker("decode", model, cores[-1], free_port(), *decode_flags)
    prefill = Worker("prefill", model, cores[0], free_port(), *AFTER)
    if len(cores) > 1:
        pin_this_process({cores[0]})
    client = DecodeClient(decode.addr)
    rng = random.Random(rng_seed)
    out = {"bytes": [], "send_s": [], "ttft": []}
    try:
        for _ in range(args.runs):
            turn1 = [rng.randrange(3, 512) for _ in range(args.turn1)]
            answer, _ = await turn(client, turn1, args.answer, prefill.addr)
            turn2 = turn1 + answer + [rng.randrange(3, 512) for _ in range(args.message)]
            b0, s0 = prefill.metric("kvrelay:kv_send_bytes_total"), prefill.metric("kvrelay:kv_send_seconds_sum")
            _, ttft = await turn(client, turn2, 8, prefill.addr)
            out["bytes"].append(prefill.metric("kvrelay:kv_send_bytes_total") - b0)
            out["send_s"].append(prefill.metric("kvrelay:kv_send_seconds_sum") - s0)
            out["ttft"].append(ttft)
        return {k: statistics.median(v) for k, v in out.items()}
    finally:
        await client.close()
        decode.stop()
        prefill.stop()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turn1", type=int, default=2048)
    ap.add_argument("--answer", type=int, default=32)
    ap.add_argument("--message", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    print(f"turn 1: {args.turn1} tokens, answer {args.answer}, turn 2 adds {args.message}; medians of {args.runs}")
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp))
        base = await run(model, ("--no-prefix-caching",), cores, args, 0)
        reuse = await run(model, (), cores, args, 0)
    for name, r in (("decode without prefix cache", base), ("decode prefix cache", reuse)):
        print(f"  {name:<28} turn 2: KV moved {r['bytes'] / 1e6:6.2f} MB in {r['send_s'] * 1e3:6.1f} ms, "
              f"TTFT {r['ttft'] * 1e3:7.1f} ms")
    print(f"  ratio: {base['bytes'] / max(reuse['bytes'], 1):.1f}x fewer bytes, hand-off "
          f"{base['send_s'] / reuse['send_s']:.1f}x faster, TTFT {reuse['ttft'] / base['ttft']:.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
