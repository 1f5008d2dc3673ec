"""`kvrelay serve --tensor-parallel-size 2` through the official openai client: the same greedy
text as one process; a worker killed with SIGKILL fails the request with a clear error and the
server exits non-zero within a deadline."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest
from gateway_helpers import GatewayProcess
from kvrelay.engine.engine_args import EngineArgs
from kvrelay.engine.llm_engine import LLMEngine
from kvrelay.engine.sampling_params import SamplingParams

PROMPT = "Once upon a time, there was a little girl named Lily. She"


def _worker_pids(pid: int) -> list[int]:
    """The spawned parallel workers among pid's descendants (the engine-core process's children,
    or serve's own with --engine-in-process), not multiprocessing's resource tracker."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            if b"spawn_main" in cmd:
                out.append(int(child))
            else:
                out += _worker_pids(int(child))
    return sorted(out)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_rank_counts(url: str, ok, timeout: float = 30.0) -> dict[str, float]:
    """kvrelay:parallel_rank_forward_seconds' count per rank, polled until ok(counts)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(url + "/metrics", timeout=10).text
        counts = {s.labels["rank"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
                  if s.name == "kvrelay:parallel_rank_forward_seconds_count"}
        if ok(counts):
            return counts
        assert time.monotonic() < deadline, f"per-rank forward counts stayed {counts}"
        time.sleep(0.2)


@pytest.mark.parametrize("mode", [[], ["--engine-in-process"]], ids=["engine_process", "in_process"])
def test_serve_tp2_matches_one_process_and_exits_when_a_worker_dies(tmp_path, mode):
    import os
    import signal

    engine = LLMEngine(EngineArgs(kv_cache_memory=4 * 2**20))
    engine.add_request(PROMPT, SamplingParams(max_tokens=16, temperature=0.0), "r")
    want = ""
    while engine.has_work():
        want += "".join(o.text for o in engine.step())

    gw = GatewayProcess(["--tensor-parallel-size", "2", "--kv-cache-memory", "4MiB", *mode], tmp_path / "serve.log")
    try:
        gw.wait_healthy(timeout=120)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=60)
        got = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=16, temperature=0)
        assert got.choices[0].text == want
        import httpx

        lines = httpx.get(gw.url + "/metrics", timeout=10).text.splitlines()
        comm = {x.split(" ")[0]: float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("kvrelay:parallel_comm")}
        assert comm['kvrelay:parallel_comm_bytes_total{kind="all_reduce"}'] > 0
        assert comm['kvrelay:parallel_comm_seconds_total{kind="all_gather"}'] > 0
        # every rank's forward time, counted per step (the engine process sends its stats every so often)
        first = _wait_rank_counts(gw.url, lambda counts: len(counts) == 2 and min(counts.values()) > 0)
        client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=4, temperature=0)
        _wait_rank_counts(gw.url, lambda counts: all(counts[r] > first[r] for r in first))

        workers = _worker_pids(gw.proc.pid)
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)
        try:  # the request fails (or is refused) with the engine's error, never hangs
            client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=16, temperature=0)
        except openai.APIStatusError as e:
            assert e.status_code in (500, 503)
        except openai.APIConnectionError:
            pass  # the server may already have exited
        else:
            pytest.fail("a request succeeded after a tensor-parallel worker died")
        deadline = time.monotonic() + 30
        while gw.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gw.proc.returncode == 1, (tmp_path / "serve.log").read_text()
        assert "died with exit code -9" in (tmp_path / "serve.log").read_text()
        assert not any(_alive(w) for w in workers)  # no orphan
    finally:
        gw.stop()


def test_disaggregated_tp2_on_both_sides_matches_one_process(tmp_path):
    prompt = PROMPT + " liked to play in the park with her dog. One day, the dog ran"  # > 2 blocks of K/V
    engine = LLMEngine(EngineArgs(kv_cache_memory=4 * 2**20))
    engine.add_request(prompt, SamplingParams(max_tokens=16, temperature=0.0), "r")
    want = ""
    while engine.has_work():
        want += "".join(o.text for o in engine.step())

    gw = GatewayProcess(["--disaggregated", "--tensor-parallel-size", "2", "--kv-cache-memory", "4MiB"],
                        tmp_path / "serve.log")
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=60)
        got = client.completions.create(model="stories260K", prompt=prompt, max_tokens=16, temperature=0)
        assert got.choices[0].text == want
    finally:
        gw.stop()


def test_serve_over_two_nodes_matches_one_process_and_exits_when_the_follower_dies(tmp_path, monkeypatch):
    """`kvrelay serve --nnodes 2` hosts rank 0, `kvrelay parallel-worker` (another process tree) rank 1."""
    import os
    import signal
    import subprocess
    import sys

    engine = LLMEngine(EngineArgs(kv_cache_memory=4 * 2**20))
    engine.add_request(PROMPT, SamplingParams(max_tokens=12, temperature=0.0), "r")
    want = ""
    while engine.has_work():
        want += "".join(o.text for o in engine.step())

    monkeypatch.setenv("KVRELAY_PARALLEL_TOKEN", "serve-test")
    port = _two_free_ports()  # torch.distributed's rendezvous, and the control listener above it
    nodes = ["--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{port}"]
    with open(tmp_path / "follower.log", "w") as log:
        follower = subprocess.Popen([sys.executable, "-m", "kvrelay.cli", "parallel-worker", "--node-rank", "1",
                                     *nodes], stdout=log, stderr=subprocess.STDOUT)
    gw = None
    try:
        gw = GatewayProcess(["--tensor-parallel-size", "2", *nodes, "--kv-cache-memory", "4MiB"], tmp_path / "serve.log")
        gw.wait_healthy(timeout=120)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=60)
        got = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=12, temperature=0)
        assert got.choices[0].text == want
        _wait_rank_counts(gw.url, lambda counts: len(counts) == 2 and min(counts.values()) > 0)

        os.kill(follower.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while gw.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        log = (tmp_path / "serve.log").read_text()
        assert gw.proc.returncode == 1, log
        assert "parallel worker rank 1 " in log and "node 1" in log
    finally:
        if gw is not None:
            gw.stop()
        follower.kill()
        follower.wait()


def _two_free_ports() -> int:
    import socket

    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            try:
                b.bind(("127.0.0.1", a.getsockname()[1] + 1))
            except OSError:
                continue
            return a.getsockname()[1]
    raise RuntimeError("no two consecutive free ports")
