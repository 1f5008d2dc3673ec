"""`kvrelay serve --disaggregated` supervises its local workers: kill -9 (or freeze) one, and serve restarts
it; meanwhile requests get a correct answer or a clean error (503 + Retry-After, an SSE error event), never
a refused connection; serve is serving again within 10 s."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
from gateway_helpers import GatewayProcess

MODEL = "stories260K"
PROMPTS = ["Once upon a time", "Lily and Tom went to the park", "The little dog was sad because"]


def _children(pid: int) -> dict[str, int]:
    """role -> pid of serve's local workers."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            for role in ("prefill", "decode"):
                if f" {role} " in cmdline:
                    found[role] = int(stat.parent.name)
    return found


def _complete(url: str, prompt: str, max_tokens: int = 12) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def _metric(url: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in httpx.get(url + "/metrics", timeout=5).text.splitlines()
               if line.startswith((name + "{", name + " ")))


@pytest.fixture
def serve(tmp_path):
    server = GatewayProcess(["--host", "127.0.0.1", "--disaggregated", "--stall-timeout", "5"],
                            tmp_path / "serve.log")
    yield server
    server.stop()


def test_killed_workers_are_restarted_and_requests_meanwhile_get_an_answer_or_a_503(serve, tmp_path):
    expected = {p: _complete(serve.url, p).json()["choices"][0]["text"] for p in PROMPTS}
    for role in ("decode", "prefill"):
        workers = _children(serve.proc.pid)
        os.kill(workers[role], signal.SIGKILL)
        killed_at, back_at = time.monotonic(), None
        statuses = set()
        while time.monotonic() - killed_at < 30:
            prompt = random.choice(PROMPTS)
            r = _complete(serve.url, prompt)  # a refused connection would raise here
            statuses.add(r.status_code)
            if r.status_code == 200:
                assert r.json()["choices"][0]["text"] == expected[prompt]
                if f"the local {role} worker is back on" in (tmp_path / "serve.log").read_text():
                    back_at = time.monotonic()  # restarted, listening, and a request after it succeeded
                    break
            else:
                assert r.status_code == 503 and r.headers["retry-after"], r.text
                assert r.json()["error"]["code"] in ("workers_unavailable", "no_healthy_workers")
            time.sleep(0.1)
        assert back_at is not None and back_at - killed_at < 10, (role, statuses)
        if role == "prefill":
            assert statuses == {200}  # the decode worker prefilled locally meanwhile
        assert _children(serve.proc.pid)[role] != workers[role]
        assert httpx.get(serve.url + "/ready").status_code == 200
    workers = _children(serve.proc.pid)
    serve.proc.send_signal(signal.SIGTERM)  # a clean stop, workers included
    assert serve.proc.wait(30) == 0
    log = (tmp_path / "serve.log").read_text()
    assert "the local decode worker exited with code -9; restarting it" in log
    assert "the local prefill worker is back on 127.0.0.1:" in log
    assert "Traceback" not in log and log.count("restarting it") == 2  # none after the SIGTERM
    deadline = time.monotonic() + 20
    while any(Path(f"/proc/{pid}").exists() for pid in workers.values()):
        assert time.monotonic() < deadline, "a worker outlived serve"
        time.sleep(0.1)


def test_stream_in_flight_on_a_killed_decode_worker_ends_with_an_sse_error_event(serve):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", serve.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert "choices" in first
        os.kill(_children(serve.proc.pid)["decode"], signal.SIGKILL)
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])["error"]
    assert error["type"] == "service_unavailable_error" and "decode" in error["message"] or "worker" in error["message"]


def test_chaos_streamed_load_while_workers_are_killed_and_frozen(serve):
    """60 s of streamed load; every few seconds a worker is killed or frozen (and thawed). Each request ends
    with the right text or a clean error; at the end serve serves and the KV pools are free."""
    expected = {p: _complete(serve.url, p, 16).json()["choices"][0]["text"] for p in PROMPTS}
    stop = threading.Event()
    outcomes: list[str] = []
    failures: list[str] = []

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            prompt = rng.choice(PROMPTS)
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True}
            try:
                with httpx.stream("POST", serve.url + "/v1/completions", json=body, timeout=40) as r:
                    if r.status_code != 200:
                        r.read()
                        err = r.json()["error"]
                        ok = r.status_code in (503, 504) and err["code"]
                        outcomes.append(f"http_{r.status_code}") if ok else failures.append(r.text)
                        continue
                    events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            except httpx.HTTPError as e:  # a refused or dropped connection is a failure
                failures.append(f"{type(e).__name__}: {e}")
                continue
            if events[-1] != "[DONE]":
                failures.append(f"stream without [DONE]: {events[-3:]}")
            elif any(e.startswith('{"error"') for e in events):
                outcomes.append("sse_error")
            else:
                text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
                (outcomes.append("ok") if text == expected[prompt]
                 else failures.append(f"wrong text {text!r} != {expected[prompt]!r}"))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    rng = random.Random(26)
    frozen: list[int] = []
    t_end = time.monotonic() + 60
    try:
        while time.monotonic() < t_end:
            time.sleep(rng.uniform(4, 8))
            workers = _children(serve.proc.pid)
            if not workers:
                continue
            role = rng.choice(sorted(workers))
            if rng.random() < 0.6:
                os.kill(workers[role], signal.SIGKILL)
            else:
                os.kill(workers[role], signal.SIGSTOP)
                frozen.append(workers[role])
                time.sleep(rng.uniform(1, 3))
                os.kill(workers[role], signal.SIGCONT)
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        stop.set()
        for t in threads:
            t.join(60)
    assert not failures, failures[:5]
    assert outcomes.count("ok") >= 10, outcomes
    # serve is serving at the end, and the pools are free once the last requests are done.
    deadline = time.monotonic() + 30
    while _complete(serve.url, PROMPTS[0]).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    assert _complete(serve.url, PROMPTS[0], 16).json()["choices"][0]["text"] == expected[PROMPTS[0]]
    deadline = time.monotonic() + 30
    while (_metric(serve.url, "kvrelay:kv_cache_usage_perc"), _metric(serve.url, "kvrelay:num_requests_running")) \
            != (0.0, 0.0):
        assert time.monotonic() < deadline, "KV blocks or requests left on the workers"
        time.sleep(0.2)
    print(f"\nchaos outcomes: { {k: outcomes.count(k) for k in set(outcomes)} }")
