"""Stall detection and circuit breakers in the gateway, against real worker processes frozen with SIGSTOP."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

import httpx
from gateway_helpers import InProcessGateway, WorkerProcess, free_port
from kvrelay.gateway.breaker import BreakerConfig, Breakers
from kvrelay.gateway.disaggregated import DisaggregatedBackend
from kvrelay.gateway.stall import StallConfig, StepTimes
from prometheus_client import CollectorRegistry, generate_latest

from kvrelay.models import BUNDLED_MODEL

MODEL = "stories260K"
STALL = 3.0  # --stall-timeout of these gateways


def wait_until(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _state_lines(breakers: Breakers) -> list[str]:
    registry = CollectorRegistry()
    registry.register(breakers)
    return [line for line in generate_latest(registry).decode().splitlines() if not line.startswith("#")]


def test_breaker_opens_half_opens_and_closes_with_one_log_line_per_change(caplog):
    now = [100.0]
    breakers = Breakers(BreakerConfig(failure_threshold=3, cooldown_s=5.0), clock=lambda: now[0])
    b = breakers.get("decode", "10.0.0.1:50051")
    caplog.set_level(logging.INFO, logger="kvrelay.gateway.breaker")
    for _ in range(2):
        b.acquire()
        b.failure("unreachable")
    assert b.state == "closed" and breakers.unavailable("decode") == set()
    b.acquire()
    b.failure("unreachable")
    assert b.state == "open" and breakers.unavailable("decode") == {"10.0.0.1:50051"}
    assert 'kvrelay:worker_circuit_state{role="decode",worker="10.0.0.1:50051"} 1.0' in _state_lines(breakers)
    b.failure("still unreachable")  # more failures while open: no new line, cool-down restarts
    now[0] += 4.9
    assert not b.available()
    now[0] += 0.2
    assert b.available()
    b.acquire()  # the one probe
    assert b.state == "half_open" and not b.available()  # a second request must not go through
    assert 'kvrelay:worker_circuit_state{role="decode",worker="10.0.0.1:50051"} 2.0' in _state_lines(breakers)
    b.failure("probe unreachable")
    assert b.state == "open"
    now[0] += 5.0
    b.acquire()
    b.success()
    assert b.state == "closed" and b.available()
    lines = _state_lines(breakers)
    assert 'kvrelay:worker_circuit_state{role="decode",worker="10.0.0.1:50051"} 0.0' in lines
    assert 'kvrelay:worker_circuit_transitions_total{role="decode",state="open",worker="10.0.0.1:50051"} 2.0' in lines
    assert 'kvrelay:worker_circuit_transitions_total{role="decode",state="half_open",worker="10.0.0.1:50051"} 2.0' \
        in lines
    changes = [r.getMessage() for r in caplog.records if "circuit" in r.getMessage()]
    assert changes == [
        "decode worker 10.0.0.1:50051: circuit closed -> open (3 consecutive failures, last: unreachable)",
        "decode worker 10.0.0.1:50051: circuit open -> half_open (5 s cool-down over: one probe)",
        "decode worker 10.0.0.1:50051: circuit half_open -> open (probe failed: probe unreachable)",
        "decode worker 10.0.0.1:50051: circuit open -> half_open (5 s cool-down over: one probe)",
        "decode worker 10.0.0.1:50051: circuit half_open -> closed (probe succeeded)",
    ]


def test_stall_timeout_follows_the_workers_step_times():
    times = StepTimes(StallConfig(max_s=30.0, min_s=2.0, factor=50.0))
    assert times.timeout("w") == 30.0  # nothing seen yet: the bound
    for _ in range(50):
        times.observe("w", 0.01)
    assert times.timeout("w") == 2.0  # 50 x 10 ms is under the floor
    for _ in range(100):
        times.observe("w", 0.2)
    assert 9.0 < times.timeout("w") <= 10.0
    for _ in range(100):
        times.observe("w", 5.0)
    assert times.timeout("w") == 30.0


async def test_breaker_opens_on_a_dead_decode_worker_and_requests_skip_it(caplog):
    caplog.set_level(logging.WARNING)
    live = WorkerProcess("decode")
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: a real connection failure every time
    backend = DisaggregatedBackend("", f"{dead},{live.address}", str(BUNDLED_MODEL),
                                   breaker=BreakerConfig(failure_threshold=2, cooldown_s=60))
    try:
        for d in backend._discovery:
            await d.refresh()
        params = backend.default_sampling_params()
        params.max_tokens, params.temperature = 2, 0.0
        for i in range(6):
            # Both look live and the dead one least loaded, as in a partition the load stream misses.
            backend.decode.report(dead, num_waiting=0, num_running=0, kv_blocks_free=100, kv_blocks_total=100)
            backend.decode.report(live.address, num_waiting=9, num_running=9, kv_blocks_free=100,
                                  kv_blocks_total=100)
            outs = [o async for o in backend.generate(backend.tokenizer.encode_prompt("Once"), params, f"b{i}")]
            assert sum(len(o.new_token_ids) for o in outs) == 2
        assert backend.retries == 2  # then the open breaker kept requests away from the dead worker
        assert backend.breakers.get("decode", dead).state == "open"
        assert sum("circuit closed -> open" in r.getMessage() for r in caplog.records) == 1
    finally:
        await backend.shutdown()
        live.stop()


def _stream(url: str, body: dict, results: list, index: int) -> None:
    """One streamed request: (status, error event or None, text, end time)."""
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        error = next((json.loads(e)["error"] for e in events if e.startswith('{"error"')), None)
        text = "".join(json.loads(e)["choices"][0]["text"] for e in events if '"choices"' in e)
        results[index] = (r.status_code, error, text, time.monotonic())
    except httpx.HTTPError as e:
        results[index] = ("transport", str(e), "", time.monotonic())


def _pools_free(*workers) -> bool:
    return all(w.metric("kvrelay:kv_cache_usage_perc") == 0.0 and w.metric("kvrelay:num_requests_running") == 0
               for w in workers)


def test_frozen_decode_worker_in_flight_requests_end_within_the_stall_timeout():
    prefill = WorkerProcess("prefill")
    d1, d2 = WorkerProcess("decode"), WorkerProcess("decode")
    backend = DisaggregatedBackend(prefill.address, f"{d1.address},{d2.address}", str(BUNDLED_MODEL),
                                   stall=StallConfig(max_s=STALL))
    gw = InProcessGateway(backend=backend)
    frozen = False
    try:
        assert wait_until(lambda: len(backend.decode.live()) == 2 and backend.prefill.live(), 30)
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                "stream": True, "temperature": 0}
        results: list = [None] * 6
        threads = [threading.Thread(target=_stream, args=(gw.url, body, results, i)) for i in range(4)]
        for t in threads:
            t.start()
        # Tokens flowing from both decode workers (the load picks alternate): then freeze one.
        assert wait_until(lambda: d1.generation_tokens() >= 5 and d2.generation_tokens() >= 5, 30)
        os.kill(d1.proc.pid, signal.SIGSTOP)
        frozen, frozen_at = True, time.monotonic()
        # Requests sent now may still pick the frozen worker (its load stream is not silent yet):
        # they get no first token and must be retried on the other one.
        late = [threading.Thread(target=_stream, args=(gw.url, {**body, "max_tokens": 8}, results, i))
                for i in (4, 5)]
        for t in [*late]:
            t.start()
        for t in [*threads, *late]:
            t.join(60)
        for status, error, text, ended in results:
            assert status == 200
            assert ended - frozen_at < STALL + 1.0 + 60 * (error is None)  # errors come within the bound
            if error is not None:  # a stream already under way on the frozen worker: a clean error
                assert "stalled" in error["message"] and text
        assert any(r[1] is not None for r in results[:4])  # at least one was on the frozen worker
        assert all(r[1] is None for r in results[4:])  # not started yet: retried elsewhere, answered
        assert all(r[3] - frozen_at < STALL + 1.0 for r in results if r[1] is not None)
        os.kill(d1.proc.pid, signal.SIGCONT)
        frozen = False
        assert wait_until(lambda: _pools_free(prefill, d1, d2), 20)
    finally:
        if frozen:
            os.kill(d1.proc.pid, signal.SIGCONT)
        gw.stop()
        for w in (prefill, d1, d2):
            w.stop()


def test_frozen_prefill_worker_in_flight_hand_offs_fall_back_within_the_hand_off_timeout():
    # Slow chunks keep hand-offs in flight when the prefill worker freezes.
    prefill = WorkerProcess("prefill", "--max-message-bytes", "8KiB", "--debug-chunk-delay", "0.2",
                            "--stream-min-tokens", "100000")
    decode = WorkerProcess("decode", "--max-message-bytes", "8KiB", "--handoff-timeout", "2")
    backend = DisaggregatedBackend(prefill.address, decode.address, str(BUNDLED_MODEL),
                                   stall=StallConfig(max_s=STALL))
    gw = InProcessGateway(backend=backend)
    frozen = False
    try:
        assert wait_until(lambda: backend.decode.live() and backend.prefill.live(), 30)
        prompt = "Once upon a time, there was a little girl named Lily. " * 6
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": True, "temperature": 0}
        results: list = [None] * 3
        threads = [threading.Thread(target=_stream, args=(gw.url, body, results, i)) for i in range(3)]
        for t in threads:
            t.start()
        assert wait_until(lambda: prefill.metric("kvrelay:num_requests_running") > 0
                          or prefill.metric("kvrelay:kv_cache_usage_perc") > 0, 20)
        os.kill(prefill.proc.pid, signal.SIGSTOP)
        frozen, frozen_at = True, time.monotonic()
        for t in threads:
            t.join(60)
        texts = {r[2] for r in results}
        assert all(r[0] == 200 and r[1] is None for r in results) and len(texts) == 1  # prefilled locally
        assert all(r[3] - frozen_at < 2.0 + 1.0 for r in results)
        assert decode.metric('kvrelay:kv_transfer_fallbacks_total{kind="local"}') >= 1
        os.kill(prefill.proc.pid, signal.SIGCONT)
        frozen = False
        assert wait_until(lambda: _pools_free(prefill, decode), 40)  # leases end once it runs again
    finally:
        if frozen:
            os.kill(prefill.proc.pid, signal.SIGCONT)
        gw.stop()
        prefill.stop()
        decode.stop()

