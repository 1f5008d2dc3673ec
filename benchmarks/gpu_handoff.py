"""The prefill/decode hand-off case of benchmarks/gpu_engine.py (section `handoff`): a 1B-shape model
(bf16, 16 layers, 8 KV heads, head_dim 64), one prefill worker and two decode workers on one GPU in
one process, real gRPC between them. TTFT (client call to first token, warm kernels, median of
--repeats) at 512, 2048 and 4000 prompt tokens: unified (the decode worker prefills itself), and
disaggregated with the K/V inline on gRPC and over the CUDA IPC plane (kvrelay.kvtransfer.cuda_ipc),
its control path on the doorbell socket (the default) and on the gRPC stream (`cuda-ipc-stream`),
with the plane's transfer speed (decode side: first chunk received to last chunk checked) and
whether every answer matches unified. Targets (issue 21): the CUDA IPC plane at 100 GB/s or more,
and at most +10% over unified TTFT at 2048 and 4000 tokens.

Under load (rows handoff_loaded_*): the same TTFT at the longest prompt while the decode worker
runs a batch of other requests' decode steps, as a decode worker in production does. Unified, the
prompt joins that batch as a mixed step; disaggregated, the decode worker's reservation and
activation each wait for the step in flight. `cuda-ipc-reserve-first` (--no-kv-early-start)
reserves before it asks the prefill worker to start, the early start's baseline. Here both
engines share one GPU (and this process's host threads), so the prefill competes with the decode
batch as it would not on a GPU of its own: these rows time the control path under load, not the
isolation that disaggregation buys (benchmarks/disagg_interference.py measures that with worker
processes on CPU).

On CPU (--cpu-smoke) the plane cannot open, so the CUDA IPC workers are wired as the tests do it:
the prefill worker answers as a GPU one would, and the decode worker opens the handle as the
prefill worker's CPU cache. Everything but the device copy is then the real protocol, which
makes the control path's CPU floor measurable here."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import random
import statistics
import time
from pathlib import Path


async def ttft(client, prompt: list[int], prefill_addr: str | None) -> tuple[float, list[int]]:
    from kvrelay.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    started = time.perf_counter()
    first, tokens = None, []
    async for out in client.generate(prompt, params, prefill_addr=[prefill_addr] if prefill_addr else []):
        if out.new_token_ids and first is None:
            first = time.perf_counter() - started
        tokens += out.new_token_ids
    return first, tokens


async def _run(rep, model_dir: Path, vocab: int, device: str, smoke: bool, engine_kw: dict, repeats: int) -> None:
    from kvrelay.decode.worker import DecodeWorker
    from kvrelay.engine.async_engine import AsyncEngine
    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.kvtransfer.client import DecodeClient
    from kvrelay.kvtransfer.worker_base import WorkerOptions
    from kvrelay.prefill.worker import PrefillWorker

    def engine() -> AsyncEngine:
        return AsyncEngine(EngineArgs(model=str(model_dir), device=device, **engine_kw))

    big = 64 * 2**20
    prefill = PrefillWorker(engine(), WorkerOptions(max_message_bytes=big))
    # The unified runs have a decode worker of their own: its prefix cache must not serve the others.
    ipc_opts = WorkerOptions(max_message_bytes=big, kv_transport="cuda-ipc")
    decodes = {"unified": DecodeWorker(engine(), WorkerOptions(max_message_bytes=big)),
               "grpc": DecodeWorker(engine(), WorkerOptions(max_message_bytes=big)),
               "cuda-ipc": DecodeWorker(engine(), ipc_opts),
               "cuda-ipc-stream": DecodeWorker(engine(), dataclasses.replace(ipc_opts, kv_doorbell=False)),
               "cuda-ipc-reserve-first": DecodeWorker(engine(), dataclasses.replace(ipc_opts, kv_early_start=False))}
    if device == "cpu":
        _cpu_ipc_protocol(prefill, *(d for m, d in decodes.items() if m.startswith("cuda-ipc")))
    paddr = f"127.0.0.1:{await prefill.start()}"
    clients = {name: DecodeClient(f"127.0.0.1:{await d.start()}") for name, d in decodes.items()}
    lengths = (32, 100) if smoke else (512, 2048, 4000)
    rng = random.Random(21)
    try:
        for n in lengths:
            times: dict[str, list[float]] = {mode: [] for mode in decodes}
            answers: dict[str, list[list[int]]] = {k: [] for k in times}
            moved: dict[str, tuple[float, float]] = {}
            computed: dict[str, float] = {}  # the prefill worker's queue + compute, summed over the runs
            for i in range(repeats + 1):  # the first round warms kernels and connections
                p = [rng.randrange(3, vocab) for _ in range(n)]  # a fresh prompt: no prefix-cache hit
                for mode, client in clients.items():
                    d = decodes[mode]
                    before = (d.metrics.kv_bytes._value.get(), d.metrics.kv_seconds._sum.get())
                    compute_before = prefill.metrics.ttft._sum.get()
                    t, tokens = await ttft(client, p, None if mode == "unified" else paddr)
                    if i:
                        times[mode].append(t)
                        answers[mode].append(tokens)
                        computed[mode] = computed.get(mode, 0.0) + prefill.metrics.ttft._sum.get() - compute_before
                        b, s = moved.get(mode, (0.0, 0.0))
                        moved[mode] = (b + d.metrics.kv_bytes._value.get() - before[0],
                                       s + d.metrics.kv_seconds._sum.get() - before[1])
            med = {m: statistics.median(v) for m, v in times.items()}
            same = all(answers[m] == answers["unified"] for m in answers)
            for mode in [m for m in decodes if m != "unified"]:
                nbytes, seconds = moved[mode]
                speed = nbytes / seconds / 1e9 if seconds else 0.0
                # Where the TTFT goes, per hand-off on average: the prefill worker's queue + compute, the
                # decode side's transfer (first chunk to last written; it overlaps the compute when layers
                # stream), and the rest of the mean TTFT beyond the compute (control path and hops).
                runs = len(times[mode])
                compute_ms, transfer_ms = computed[mode] / runs * 1e3, seconds / runs * 1e3
                beyond_ms = statistics.mean(times[mode]) * 1e3 - compute_ms
                rep.add(f"handoff_{mode}_{n}", {"ttft_ms": med[mode] * 1e3, "unified_ms": med["unified"] * 1e3,
                                                 "gb_s": speed, "bytes": nbytes / repeats, "identical": same,
                                                 "prefill_compute_ms": compute_ms, "transfer_ms": transfer_ms,
                                                 "beyond_compute_ms": beyond_ms},
                        f"hand-off {n} tokens over {mode}: TTFT {med[mode] * 1e3:.1f} ms vs unified "
                        f"{med['unified'] * 1e3:.1f} ms ({(med[mode] / med['unified'] - 1) * 100:+.0f}%), "
                        f"{nbytes / repeats / 1e6:.2f} MB at {speed:.2f} GB/s, identical: {same}; per hand-off: "
                        f"prefill compute {compute_ms:.1f} ms, transfer {transfer_ms:.2f} ms, TTFT beyond the "
                        f"compute {beyond_ms:.1f} ms")
        # Where the TTFT goes, hop by hop, at the longest prompt (handoff_trace.py).
        from handoff_trace import Tracer

        for mode in ("cuda-ipc", "cuda-ipc-stream"):
            tracer = Tracer()
            with tracer.installed():
                for _ in range(max(3, repeats)):
                    p = [rng.randrange(3, vocab) for _ in range(lengths[-1])]
                    started = tracer.start()
                    t, _ = await ttft(clients[mode], p, paddr)
                    tracer.record(started, t)
            stages = tracer.medians()
            rep.add(f"handoff_trace_{mode}_{lengths[-1]}", dict(stages),
                    f"hand-off {lengths[-1]} tokens over {mode}, stages (median ms from the client's call): "
                    + "; ".join(f"{label} {ms:.2f}" for label, ms in stages))
        await _under_load(rep, clients, decodes, paddr, lengths[-1], vocab, rng, smoke, repeats)
        ipc = decodes["cuda-ipc"].transport.cuda_ipc
        failures = {m: sum(s.value for metric in d.metrics.failures.collect() for s in metric.samples
                           if s.name.endswith("_total")) for m, d in decodes.items()}
        rep.add("handoff_failures", failures, f"failed hand-offs by decode worker: {failures}")
        rung = prefill.metrics.doorbells.labels("connected")._value.get()
        rep.add("handoff_cuda_ipc_active", ipc is not None,
                f"cuda-ipc plane {'active' if ipc is not None else 'unavailable (K/V went inline)'}; prefill "
                f"answered {prefill.metrics.plane_handoffs.labels('cuda-ipc')._value.get():.0f} offers, "
                f"{rung:.0f} of them on the doorbell")
    finally:
        for c in clients.values():
            await c.close()
        await prefill.stop(0)
        for d in decodes.values():
            await d.stop(0)


async def _under_load(rep, clients, decodes, paddr: str, n: int, vocab: int, rng, smoke: bool, repeats: int) -> None:
    """TTFT of an n-token prompt while the decode worker decodes a batch of other requests (one
    mode at a time: the modes share the GPU), traced hop by hop when disaggregated."""
    from handoff_trace import Tracer

    batch = 8 if smoke else 64
    for mode in ("unified", "cuda-ipc", "cuda-ipc-reserve-first"):
        client, engine = clients[mode], decodes[mode].engine
        tasks = await _start_decoding(client, batch, vocab, rng, engine.engine.max_model_len)
        # The background's outputs would pass for the traced request's first output: not traced.
        tracer = Tracer(exclude={"decode: first output"})
        times = []
        try:
            for i in range(repeats + 1):  # the first warms the path under load
                p = [rng.randrange(3, vocab) for _ in range(n)]
                with tracer.installed():
                    started_at = tracer.start()
                    t, _ = await ttft(client, p, None if mode == "unified" else paddr)
                if i:
                    times.append(t)
                    tracer.record(started_at, t)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        med, step_ms = statistics.median(times) * 1e3, engine.mean_step_s * 1e3
        stages = tracer.medians()
        rep.add(f"handoff_loaded_{mode}_{n}", {"ttft_ms": med, "decode_batch": batch, "mean_step_ms": step_ms,
                                                "stages": dict(stages)},
                f"hand-off {n} tokens under load ({batch} requests decoding, mean step {step_ms:.1f} ms) over "
                f"{mode}: TTFT {med:.1f} ms" + ("" if mode == "unified" else "; stages (median ms): " + "; ".join(
                    f"{label} {ms:.2f}" for label, ms in stages)))


async def _start_decoding(client, batch: int, vocab: int, rng, max_model_len: int) -> list[asyncio.Task]:
    """batch requests decoding on the client's worker (local prefill), once each has its first token."""
    from kvrelay.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=min(2000, max_model_len - 65), ignore_eos=True)
    decoding: set[int] = set()
    all_decoding = asyncio.Event()

    async def decode(k: int, prompt: list[int]) -> None:
        async for out in client.generate(prompt, params):
            if out.new_token_ids and k not in decoding:
                decoding.add(k)
                if len(decoding) == batch:
                    all_decoding.set()

    tasks = [asyncio.create_task(decode(k, [rng.randrange(3, vocab) for _ in range(64)])) for k in range(batch)]
    await asyncio.wait_for(all_decoding.wait(), 120)
    return tasks


def _cpu_ipc_protocol(prefill, *decodes) -> None:
    """CPU rehearsal: the CUDA IPC protocol between these workers, the handle opening as the
    prefill worker's CPU cache (as tests/workers/test_pd_cuda_ipc.py does)."""
    from kvrelay.kvtransfer import cuda_ipc
    from kvrelay.v1 import kv_pb2

    cache = prefill.llm.kv_cache
    handle = kv_pb2.CudaIpcCache(shape=list(cache.shape), nonce=b"cpu-rehearsal-16")
    prefill.cuda_ipc.refusal = lambda offer: None
    prefill.cuda_ipc._handle = handle  # answer() exports nothing once it holds a handle
    for d in decodes:
        t = d.transport
        t.cuda_ipc = cuda_ipc.CudaIpcSources(t.layout, cache.device, "", d.metrics, opener=lambda msg, dtype: cache)
        if d.options.kv_doorbell:
            t.doorbell = d.doorbell = d._open_ipc_doorbell()


WORKER_MODULES = ("grpc", "google.protobuf", "xxhash", "prometheus_client")  # the workers' own dependencies


def section_handoff(rep, model_dir: Path, vocab: int, device: str, smoke: bool, engine_kw: dict,
                    repeats: int = 3) -> None:
    missing = [m for m in WORKER_MODULES if importlib.util.find_spec(m.split(".")[0]) is None]
    if missing:  # a bare GPU machine has torch, triton and transformers only: say so, do not fail the run
        rep.add("handoff_skipped", missing, f"hand-off section skipped: {', '.join(missing)} not installed "
                                            f"(pip install grpcio protobuf xxhash prometheus-client)")
        return
    kw = dict(engine_kw)
    kw["kv_cache_memory"] = 64 * 2**20 if smoke else 2 * 2**30  # three engines share the device
    kw.pop("gpu_memory_utilization", None)
    asyncio.run(_run(rep, model_dir, vocab, device, smoke, kw, repeats))
