"""Disaggregated prefill/decode vs single process, on loopback.

Starts worker processes (each pinned to its own core where the machine has them, one torch
thread each; the client shares the core of the process that does not decode) with a dummy ~32M-parameter Llama, and for prompts of 128 to 4096 tokens prints
  - TTFT and decode tokens/s seen by the client, single process vs prefill+decode,
  - KV hand-off bytes and GB/s, timed by the prefill worker from the end of the prefill (before the
    blocks are gathered) to every chunk verified and in the decode worker's cache: on the doorbell
    the time its ack stamps (one monotonic clock on one node; how much later the prefill worker
    read that ack is printed beside it), on gRPC the ack's arrival. The decode worker's own figure
    (first chunk received -> last chunk written) leaves out the gather and the first chunk's trip,
    so it reads higher; it is printed beside it,
  - layer-wise streaming: TTFT with streaming on, and the share of KV bytes sent while the
    prefill was still computing (overlap),
  - both data planes: K/V inline on the gRPC stream ("disagg"), and through the decode worker's
    shared-memory arena ("shm", --kv-shm-bytes: what a prefill and decode pod on one node use),
    whose hand-offs signal on the doorbell socket between the engine threads; "shm,
    gRPC-signalled" (--no-kv-doorbell) signals on the gRPC stream instead, as the doorbell's
    baseline; "shm, direct" (prefill --kv-shared-cache) has the decode worker copy the blocks
    straight out of the prefill worker's cache instead of through the region (one copy, not two),
  - the Mooncake transfer engine ("mooncake", decode --kv-transport mooncake): the prefill worker
    writes each chunk over the engine's TCP protocol into a region the decode worker registered
    (what pods on different nodes use without RDMA), beside the gRPC stream ("disagg").
The single-process baseline is a decode worker prefilling locally: same process, same client
path, no hand-off. Configurations run one after another, each with only its own workers alive:
with all five workers up at once on 2 cores, loopback TCP stalled hand-offs for 80-200 ms
(nstat: TCPLossProbes, spurious retransmits, a zero-window advert), which is not what separate
pods see.

    .venv/bin/python benchmarks/disagg.py [--lengths 128,512,1024,2048,4096] [--runs 3] [--only shm,mooncake]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.client import DecodeClient

from kvrelay.models import BUNDLED_MODEL

sys.path.insert(0, str(Path(__file__).parent))
from common import WorkerProcess, free_port

CONFIG = {  # ~32M parameters: 5 layers x 6.3M + embeddings; GQA 12 query / 4 KV heads of 64
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 768,
    "intermediate_size": 2048, "num_hidden_layers": 5, "num_attention_heads": 12, "num_key_value_heads": 4,
    "max_position_embeddings": 4608, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
}


def make_model(root: Path) -> Path:
    d = root / "dummy-32m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(CONFIG))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(BUNDLED_MODEL / name, d / name)
    return d


class Worker(WorkerProcess):
    def __init__(self, role: str, model: Path, core: int | None, metrics_port: int, *extra: str):
        cmd = [sys.executable, "-m", "kvrelay.cli", role, "--model", str(model), "--load-format", "dummy",
               "--host", "127.0.0.1", "--port", "0", "--metrics-port", str(metrics_port),
               "--num-kv-blocks", "640", "--max-num-batched-tokens", "8192", *extra]
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if core is not None and shutil.which("taskset"):
            cmd = ["taskset", "-c", str(core), *cmd]
        super().__init__(cmd, metrics_port, env)
        if core is not None and not shutil.which("taskset"):
            os.sched_setaffinity(self.proc.pid, {core})  # before torch starts its threads
        self.wait_ready(timeout_s=300)


async def one_request(client: DecodeClient, prompt: list[int], params, prefill_addr) -> tuple[float, float]:
    t0 = time.perf_counter()
    ttft, n = None, 0
    async for out in client.generate(prompt, params, prefill_addr=prefill_addr):
        if out.new_token_ids and ttft is None:
            ttft = time.perf_counter() - t0
        n += len(out.new_token_ids)
    decode_s = time.perf_counter() - t0 - ttft
    return ttft, (n - 1) / decode_s if decode_s > 0 else float("nan")


AFTER, STREAMED = ("--stream-min-tokens", "1000000"), ("--stream-min-tokens", "0", "--layer-group-size", "1")
SHM = ("--kv-shm-bytes", "128MiB")
MOONCAKE = ("--kv-transport", "mooncake", "--kv-remote-bytes", "128MiB")
CONFIGS = (  # name, prefill worker flags (None: no prefill worker, the decode worker prefills), decode flags
    ("single process", None, ()),
    ("disagg, after prefill", AFTER, ()),
    ("disagg, layer-streamed", STREAMED, ()),
    ("shm, after prefill", AFTER, SHM),
    ("shm, gRPC-signalled", AFTER, (*SHM, "--no-kv-doorbell")),  # the doorbell's baseline
    ("shm, direct", (*AFTER, "--kv-shared-cache"), SHM),  # doorbell, copied out of the prefill's cache
    ("shm, layer-streamed", STREAMED, SHM),
    ("mooncake, after prefill", AFTER, MOONCAKE),
    ("mooncake, layer-streamed", STREAMED, MOONCAKE),
)
COUNTERS = ("kvrelay:kv_transfer_bytes_total", "kvrelay:kv_transfer_seconds_sum",
            "kvrelay:kv_transfer_overlapped_bytes_total")


SENDER_COUNTERS = ("kvrelay:time_to_first_token_seconds_sum", "kvrelay:kv_send_bytes_total",
                   "kvrelay:kv_send_seconds_sum", "kvrelay:kv_doorbell_ack_delay_seconds_sum",
                   "kvrelay:kv_doorbell_ack_delay_seconds_count")


def counters(decode: Worker, prefill: Worker | None) -> tuple[float, ...]:
    p = tuple(prefill.metric(c) if prefill else 0.0 for c in SENDER_COUNTERS)
    return (*(decode.metric(c) for c in COUNTERS), *p)


def pin_this_process(cores: set[int]) -> None:
    """Every thread of this process onto cores (gRPC's too, which sched_setaffinity(0) would miss)."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cores)


async def run_config(model: Path, flags, decode_flags, cores, prompts: dict[int, list[list[int]]],
                     params) -> dict[int, dict]:
    """Start one configuration's workers, warm up, run every prompt, stop them."""
    core_a, core_b = cores
    decode = Worker("decode", model, core_b if flags else core_a, free_port(), *decode_flags)
    prefill = Worker("prefill", model, core_a, free_port(), *flags) if flags else None
    if core_b is not None:
        # The client shares a core with the process that does not generate tokens (the prefill
        # worker, or nobody beside the single process). Left to the scheduler, it sometimes ran
        # on the decode worker's core and read the first token 1-6 ms late, behind a decode step.
        pin_this_process({core_a} if flags else {core_b})
    client = DecodeClient(decode.addr)
    addr = prefill.addr if prefill else None
    try:
        await one_request(client, [random.Random(1).randrange(3, 512) for _ in range(64)], params, addr)  # warm-up
        results = {}
        for n, runs in prompts.items():
            before = counters(decode, prefill)
            samples = [await one_request(client, prompt, params, addr) for prompt in runs]
            b, s, o, pt, sb, ss, ack_s, acks = (x - y for x, y in zip(counters(decode, prefill), before))
            ttfts = [t for t, _ in samples]
            results[n] = {
                "ttft": statistics.median(ttfts), "tps": statistics.median(r for _, r in samples),
                "mb": b / len(runs) / 1e6, "gbps": sb / ss / 1e9 if ss else float("nan"),
                "rx_gbps": b / s / 1e9 if s else float("nan"), "overlap": o / b if b else float("nan"),
                "exposed": statistics.mean(ttfts) - pt / len(runs), "bytes": b,
                "ack_ms": ack_s / acks * 1e3 if acks else None}
        return results
    finally:
        await client.close()
        decode.stop()
        if prefill:
            prefill.stop()


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="128,512,1024,2048,4096")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated name parts of the hand-off configurations to run "
                                                "(e.g. shm); the single process always runs")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    cores = sorted(os.sched_getaffinity(0))
    core_a, core_b = cores[0], cores[1] if len(cores) > 1 else None
    print(f"cores available: {cores}; prefill workers and the single process on core {core_a}, decode workers "
          f"on core {core_b}, this client on the core that does not decode; 1 torch thread each; one configuration's "
          f"workers at a time, same prompts")
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    rng = random.Random(0)
    # Fresh prompts (no prefix-cache hits), the same ones for every configuration.
    prompts = {n: [[rng.randrange(3, 512) for _ in range(n)] for _ in range(args.runs)] for n in lengths}
    results: dict[str, dict[int, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp))
        for name, flags, decode_flags in CONFIGS:
            if args.only and name != "single process" and not any(k in name for k in args.only.split(",")):
                continue
            results[name] = await run_config(model, flags, decode_flags, (core_a, core_b), prompts, params)
            for n, r in results[name].items():
                line = f"  {name:<22} {n:>5} tokens: TTFT {r['ttft'] * 1000:8.1f} ms  decode {r['tps']:6.1f} tok/s"
                if r["bytes"]:
                    # Streamed chunks leave while the prompt computes: their "speed" measures compute.
                    speed = "overlaps compute" if r["overlap"] else f"{r['gbps']:5.2f} GB/s (receiver {r['rx_gbps']:4.2f})"
                    if r["ack_ms"] is not None:
                        speed += f", ack read {r['ack_ms']:.2f} ms after the write"
                    line += (f"  KV {r['mb']:6.1f} MB, {speed}, sent during compute {r['overlap']:4.0%}, "
                             f"TTFT beyond prefill {r['exposed'] * 1000:6.1f} ms")
                print(line, flush=True)
    print("\nsummary (medians; TTFT beyond prefill = client TTFT - the prefill worker's own queue+compute time)")
    base = results["single process"]
    for name in results:
        if name == "single process":
            continue
        for n in lengths:
            r = results[name][n]
            speed = "" if r["overlap"] else f", KV {r['gbps']:.2f} GB/s"
            print(f"  {name:<22} {n:>5} tokens: TTFT {r['ttft'] / base[n]['ttft'] - 1:+6.1%} vs single process{speed}, "
                  f"hand-off beyond prefill {r['exposed'] * 1000:.1f} ms ({r['exposed'] / base[n]['ttft']:.1%} of "
                  f"single-process TTFT), sent during compute {r['overlap']:.0%}")
    for plane in ("disagg", "shm", "mooncake"):
        after, streamed = results.get(f"{plane}, after prefill"), results.get(f"{plane}, layer-streamed")
        for n in lengths if after and streamed else ():
            if after[n]["exposed"] > 0:
                print(f"  {plane}: layer-wise streaming hides {1 - streamed[n]['exposed'] / after[n]['exposed']:.0%} "
                      f"of the hand-off at {n} tokens")
    bell, grpc_signalled = results.get("shm, after prefill"), results.get("shm, gRPC-signalled")
    for n in lengths if bell and grpc_signalled else ():
        print(f"  shm: doorbell {bell[n]['gbps']:.2f} GB/s vs gRPC-signalled {grpc_signalled[n]['gbps']:.2f} GB/s at {n} "
              f"tokens ({bell[n]['gbps'] / grpc_signalled[n]['gbps']:.2f}x)")
    inline, mooncake = results.get("disagg, after prefill"), results.get("mooncake, after prefill")
    for n in lengths if inline and mooncake else ():
        print(f"  mooncake (TCP) {mooncake[n]['gbps']:.2f} GB/s vs inline on gRPC {inline[n]['gbps']:.2f} GB/s at {n} "
              f"tokens ({mooncake[n]['gbps'] / inline[n]['gbps']:.2f}x)")
    direct = results.get("shm, direct")
    for n in lengths if bell and direct else ():
        print(f"  shm: direct {direct[n]['gbps']:.2f} GB/s vs through the region {bell[n]['gbps']:.2f} GB/s at {n} "
              f"tokens ({direct[n]['gbps'] / bell[n]['gbps']:.2f}x)")


if __name__ == "__main__":
    asyncio.run(main())
