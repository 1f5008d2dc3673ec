"""The `handoff_procs` section of benchmarks/gpu_engine.py: the hand-off as pods run it, one
prefill and one decode worker each in its own process (`kvrelay prefill|decode`), so the CUDA IPC
plane opens a real IPC handle between them and neither worker shares the other's interpreter
(benchmarks/gpu_handoff.py runs every worker in one process, where the handle opens as the tensor
itself and all their threads take turns at one GIL).

The decode worker offers the CUDA IPC plane (`--kv-transport cuda-ipc`, doorbell on); each prompt
goes once to it alone (unified: it prefills locally) and once with the prefill worker's address.
Printed per prompt length: median TTFT both ways, and the bytes each plane carried according to
the decode worker's /metrics, which shows whether the IPC plane or its inline fallback ran (on a
CPU smoke run it is always the fallback). Both workers run eagerly (--enforce-eager): the TTFT is
a prefill's, and capturing decode graphs would only lengthen their start.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import tempfile
from pathlib import Path

from common import WorkerProcess, free_port
from gpu_handoff import ttft

PLANES = ("grpc", "cuda-ipc", "shm")


def _worker(role: str, model_dir: Path, device: str, *extra: str) -> WorkerProcess:
    port = free_port()
    return WorkerProcess([sys.executable, "-m", "kvrelay.cli", role, "--model", str(model_dir), "--host", "127.0.0.1",
                          "--port", "0", "--metrics-port", str(port), "--device", device, "--enforce-eager", *extra],
                         port)


def _plane_bytes(worker: WorkerProcess) -> dict[str, float]:
    return {p: worker.metric("kvrelay:kv_plane_transfer_bytes_total", f'plane="{p}"') for p in PLANES}


async def _measure(rep, decode: WorkerProcess, prefill: WorkerProcess, vocab: int, lengths, repeats: int) -> None:
    from kvrelay.kvtransfer.client import DecodeClient

    rng = random.Random(22)
    async with DecodeClient(decode.addr) as client:
        for n in lengths:
            times: dict[str, list[float]] = {"unified": [], "cuda-ipc": []}
            before = _plane_bytes(decode)
            for i in range(repeats + 1):  # the first warms kernels and connections
                for mode, measured in times.items():
                    prompt = [rng.randrange(3, vocab) for _ in range(n)]  # fresh: no prefix-cache hit
                    t, _ = await ttft(client, prompt, prefill.addr if mode == "cuda-ipc" else None)
                    if i:
                        measured.append(t)
            moved = {p: b - before[p] for p, b in _plane_bytes(decode).items() if b > before[p]}
            med = {m: statistics.median(v) * 1e3 for m, v in times.items()}
            rep.add(f"handoff_procs_{n}", {"unified_ms": med["unified"], "disaggregated_ms": med["cuda-ipc"],
                                           "bytes_by_plane": moved},
                    f"hand-off {n} tokens, workers in their own processes: TTFT {med['cuda-ipc']:.1f} ms vs unified "
                    f"{med['unified']:.1f} ms ({(med['cuda-ipc'] / med['unified'] - 1) * 100:+.0f}%); bytes by plane "
                    f"{ {p: f'{b / 1e6:.1f} MB' for p, b in moved.items()} }")
    fallbacks = decode.metric("kvrelay:kv_transfer_fallbacks_total", 'kind="local"')
    rep.add("handoff_procs_fallbacks", fallbacks, f"hand-offs the decode worker prefilled locally instead: {fallbacks:.0f}")


def section_handoff_procs(rep, model_dir: Path, vocab: int, device: str, smoke: bool, repeats: int) -> None:
    kv = ("--kv-cache-memory", "64MiB" if smoke else "2GiB")
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as shm_dir:
        workers = [_worker("prefill", model_dir, device, *kv),
                   _worker("decode", model_dir, device, *kv, "--kv-transport", "cuda-ipc", "--kv-shm-dir", shm_dir)]
        try:
            for w in workers:
                w.wait_ready()
            lengths = (32, 100) if smoke else (512, 2048, 4000)
            asyncio.run(_measure(rep, workers[1], workers[0], vocab, lengths, repeats))
        finally:
            for w in workers:
                w.stop()
