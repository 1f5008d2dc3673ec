"""The step-loop watchdog: a worker (or serve) whose step loop hangs turns unready and unhealthy, drops off
its load stream, and exits with code 1 after the grace period. The hang comes from a test hook."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import httpx
import pytest
from gateway_helpers import free_port
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.client import DecodeClient, watch_load
from kvrelay.kvtransfer.errors import WorkerUnavailableError
from kvrelay.kvtransfer.watchdog import HANG_AFTER_STEPS_ENV

HANG = {HANG_AFTER_STEPS_ENV: "3"}


async def _drain(gen) -> None:
    async for _ in gen:
        pass


def _reason(url: str) -> str:
    return httpx.get(url, timeout=2).json()["reason"]


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return -1


def _start_hanging_decode_worker(metrics_port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvrelay.cli", "decode", "--host", "127.0.0.1", "--port", "0",
                             "--metrics-port", str(metrics_port), "--watchdog-timeout", "1", "--watchdog-grace", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ | HANG)


async def test_worker_with_a_hung_step_loop_turns_unready_and_exits():
    metrics_port = free_port()
    proc = _start_hanging_decode_worker(metrics_port)
    try:
        address = None
        for line in proc.stdout:
            if " listening on " in line:
                address = line.split(" listening on ")[1].split()[0]
                break
        assert address is not None, proc.stderr.read()
        base = f"http://127.0.0.1:{metrics_port}"
        assert _status(base + "/ready") == 200 and _status(base + "/health") == 200
        reports = watch_load(address, 0.1)
        assert (await reports.__anext__()).num_running == 0
        client = DecodeClient(address)
        gen = client.generate([1, 2, 3, 4], SamplingParams(max_tokens=50, temperature=0.0), "hang-1")
        outputs = asyncio.ensure_future(_drain(gen))
        t0 = time.monotonic()
        with pytest.raises(WorkerUnavailableError, match="unhealthy"):  # the load stream ends
            while True:
                await reports.__anext__()
        assert time.monotonic() - t0 < 5
        assert _status(base + "/ready") == 503 and _status(base + "/health") == 503
        assert "step loop made no progress" in _reason(base + "/health")
        assert await asyncio.to_thread(proc.wait, 20) == 1  # after the 3 s grace
        stderr = proc.stderr.read()
        assert "exiting so that it is restarted" in stderr and "Traceback" not in stderr
        with pytest.raises(WorkerUnavailableError):
            await outputs  # the request in flight fails as the worker goes (3 tokens came before the hang)
        await client.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_serve_with_a_hung_engine_turns_unready_and_exits(tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "kvrelay.cli", "serve", "--port", str(port),
                             "--watchdog-timeout", "1", "--watchdog-grace", "3"],
                            stdout=log, stderr=subprocess.STDOUT, env=os.environ | HANG)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while _status(base + "/ready") != 200:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        # The request's steps hang the loop; the client gives up, the server must not.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/v1/completions", timeout=2.5,
                       json={"model": "stories260K", "prompt": "Once", "max_tokens": 50})
        assert _status(base + "/ready") == 503 and _status(base + "/health") == 503
        assert proc.wait(30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        log.close()
    assert "still hung" in (tmp_path / "serve.log").read_text()
