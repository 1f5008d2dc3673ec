"""Helpers of the prefill/decode worker tests: tiny models, in-process worker pairs, worker
subprocesses (for kill tests), and the stranded-block checks."""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from kvrelay.engine.async_engine import AsyncEngine
from kvrelay.engine.engine_args import EngineArgs
from kvrelay.kvtransfer.client import DecodeClient, LoadReport, watch_load
from kvrelay.kvtransfer.worker_base import WorkerOptions, make_engine

from kvrelay.models import BUNDLED_MODEL

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def save_tiny_llama(path: Path) -> Path:
    """A random 2-layer Llama (vocab 512) with peaked logits, beside the bundled tokenizer."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(4321)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(BUNDLED_MODEL / name, path / name)
    return path


ABORT_GRACE_S = 5.0


@dataclass
class Pair:
    prefill: object  # PrefillWorker
    decode: object  # DecodeWorker
    prefill_addr: str
    decode_addr: str
    client: DecodeClient


async def start_pair(model: Path | str = BUNDLED_MODEL, num_kv_blocks: int = 96,
                     prefill_options: WorkerOptions | None = None,
                     decode_options: WorkerOptions | None = None, **decode_engine_args) -> Pair:
    """decode_engine_args: more EngineArgs for the decode worker's engine (e.g. async_scheduling)."""
    from kvrelay.decode.worker import DecodeWorker
    from kvrelay.prefill.worker import PrefillWorker

    popts = prefill_options or WorkerOptions()
    p = PrefillWorker(make_engine(EngineArgs(model=str(model), num_kv_blocks=num_kv_blocks), popts), popts)
    d = DecodeWorker(AsyncEngine(EngineArgs(model=str(model), num_kv_blocks=num_kv_blocks, **decode_engine_args)),
                     decode_options or WorkerOptions())
    pp, dp = await p.start(), await d.start()
    if hasattr(d.transport, "abort_grace_s"):
        # Margin for a loaded 2-core machine: the prefill worker ends an aborted call only after its
        # engine thread released the blocks. Past the grace the region is quarantined for 60 s, and
        # tests that check it comes back would fail on the load, not on a leak. (A decode side that
        # never saw the call end waits out any grace: test_pd_early_start's given-up pulls.)
        d.transport.abort_grace_s = ABORT_GRACE_S
    return Pair(p, d, f"127.0.0.1:{pp}", f"127.0.0.1:{dp}", DecodeClient(f"127.0.0.1:{dp}"))


async def stop_pair(pair: Pair) -> None:
    await pair.client.close()
    await pair.prefill.stop(0)
    await pair.decode.stop(0)


async def pool_state(engine: AsyncEngine) -> tuple[int, int]:
    """(free, total) blocks, read on the engine thread."""
    return await engine.call_in_engine_thread(lambda llm: (llm.pool.num_free, llm.pool.num_blocks))


async def assert_all_free(*engines: AsyncEngine, timeout_s: float = 10.0) -> None:
    """Zero stranded blocks: every pool back to fully free (cached-but-free blocks count as free)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = [await pool_state(e) for e in engines]
        if all(free == total for free, total in states):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"stranded KV blocks: (free, total) per pool = {states}")
        await asyncio.sleep(0.05)


async def load_report(addr: str) -> LoadReport:
    async for report in watch_load(addr, interval_s=0.1):
        return report


async def assert_worker_free(addr: str, timeout_s: float = 10.0) -> LoadReport:
    """Zero stranded blocks on a worker process, read from its load stream."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = await load_report(addr)
        if report.all_blocks_free and report.active_handoffs == 0:
            return report
        if time.monotonic() > deadline:
            raise AssertionError(f"stranded KV blocks on {addr}: {report.kv_blocks_free} of "
                                 f"{report.kv_blocks_total} free, {report.active_handoffs} hand-offs open")
        await asyncio.sleep(0.05)


class WorkerProcess:
    """`kvrelay prefill|decode` in a subprocess on a free loopback port."""

    def __init__(self, role: str, *args: str, model: Path | str = BUNDLED_MODEL, num_kv_blocks: int = 96):
        cmd = [sys.executable, "-m", "kvrelay.cli", role, "--host", "127.0.0.1", "--port", "0", "--model", str(model),
               "--num-kv-blocks", str(num_kv_blocks), *args]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.lines: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            m = re.search(r"kvrelay \w+ listening on ([\d.]+):(\d+)", line)
            if m:
                self.addr = f"{m.group(1)}:{m.group(2)}"
                # Keep draining its output so a chatty worker never blocks on a full pipe.
                threading.Thread(target=self._drain, daemon=True).start()
                return
        self.kill()
        raise RuntimeError(f"{role} worker did not start:\n{''.join(self.lines)}")

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def metric_value(text: str, name: str, labels: str = "") -> float:
    """Value of `name{labels}` in a Prometheus text page; 0 if absent."""
    key = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def wait_until(predicate, timeout_s: float = 15.0, what: str = "condition") -> None:
    """Poll predicate (a function returning a bool, or an awaitable of one) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not await _truth(predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def _truth(value) -> bool:
    return bool(await value) if inspect.isawaitable(value) else bool(value)


async def reference_tokens(prompt: list[int], params, model: Path | str = BUNDLED_MODEL) -> list[int]:
    engine = AsyncEngine(EngineArgs(model=str(model), num_kv_blocks=96))
    await engine.start()
    try:
        return [t async for o in engine.generate(prompt, params) for t in o.new_token_ids]
    finally:
        await engine.shutdown()


async def hold_engine_thread(engine: AsyncEngine):
    """Block the engine thread (as a long step would) until the returned event is set; also
    returns the future of the blocking call."""
    busy, release = threading.Event(), threading.Event()
    held = engine.call_in_engine_thread(lambda llm: (busy.set(), release.wait(30)))
    assert await asyncio.to_thread(busy.wait, 10)
    return release, held
