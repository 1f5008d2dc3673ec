"""The gateway in front of real prefill and decode worker processes (gRPC), as `kvrelay gateway` runs."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from gateway_helpers import GatewayProcess, InProcessGateway, WorkerProcess, free_port
from kvrelay.gateway.disaggregated import DisaggregatedBackend

from kvrelay.models import BUNDLED_MODEL

MODEL = "stories260K"


@pytest.fixture(scope="module")
def workers():
    started = []
    try:
        for role in ("prefill", "decode", "decode"):
            started.append(WorkerProcess(role))
        yield started
    finally:
        for w in started:
            w.stop()


@pytest.fixture(scope="module")
def cluster_gateway(workers):
    prefill, d1, d2 = workers
    backend = DisaggregatedBackend(prefill.address, f"{d1.address},{d2.address}", str(BUNDLED_MODEL))
    gw = InProcessGateway(backend=backend)
    deadline = time.monotonic() + 30
    while len(backend.decode.live()) < 2 or not backend.prefill.live():
        assert time.monotonic() < deadline, "workers never reported their load"
        time.sleep(0.05)
    yield gw
    gw.stop()


def test_completions_through_workers_match_the_local_engine(cluster_gateway, open_gateway):
    remote = openai.OpenAI(base_url=cluster_gateway.url + "/v1", api_key="x", max_retries=0)
    local = openai.OpenAI(base_url=open_gateway.url + "/v1", api_key="x", max_retries=0)
    kwargs = {"model": MODEL, "prompt": "Once upon a time, there was a little girl named Lily. She loved",
              "max_tokens": 24, "temperature": 0}
    expected = local.completions.create(**kwargs).choices[0].text
    assert remote.completions.create(**kwargs).choices[0].text == expected
    chunks = list(remote.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    biased = {**kwargs, "logit_bias": {"300": 100}}  # crosses the gRPC hop in the sampling params
    kept = {**kwargs, "stop": [expected.split()[2]], "extra_body": {"include_stop_str_in_output": True}}
    got = remote.completions.create(**kept).choices[0]
    assert got.text.endswith(expected.split()[2]) and got.model_extra["stop_reason"] == expected.split()[2]
    assert got.text == local.completions.create(**kept).choices[0].text
    assert remote.completions.create(**biased).choices[0].text == local.completions.create(**biased).choices[0].text
    chat = remote.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5)
    assert chat.usage.completion_tokens == 5
    metrics = httpx.get(cluster_gateway.url + "/metrics").text
    assert 'kvrelay:gateway_queue_depth{model="stories260K",role="prefill"} 0.0' in metrics
    assert 'kvrelay:gateway_queue_depth{model="stories260K",role="decode"} 0.0' in metrics


async def test_decode_failing_before_first_token_is_retried_elsewhere(workers):
    """A backend whose pool holds a dead address that still looks live and least loaded."""
    prefill, d1, _ = workers
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there: a real gRPC connection failure
    backend = DisaggregatedBackend(prefill.address, f"{dead},{d1.address}", str(BUNDLED_MODEL))
    # No start(): no load watchers, so the test sets the pools' view itself.
    for d in backend._discovery:
        await d.refresh()
    backend.prefill.report(prefill.address, num_waiting=0, num_running=0, kv_blocks_free=100, kv_blocks_total=100)
    backend.decode.report(dead, num_waiting=0, num_running=0, kv_blocks_free=100, kv_blocks_total=100)
    backend.decode.report(d1.address, num_waiting=5, num_running=50, kv_blocks_free=100, kv_blocks_total=100)
    assert backend.decode.pick_decode().address == dead
    params = backend.default_sampling_params()
    params.max_tokens, params.temperature = 3, 0.0
    outs = [o async for o in backend.generate(backend.tokenizer.encode_prompt("Once"), params, "retry-1")]
    assert sum(len(o.new_token_ids) for o in outs) == 3 and outs[-1].finish_reason == "length"
    assert backend.retries == 1
    await backend.shutdown()


def test_client_disconnect_frees_blocks_on_the_workers(cluster_gateway, workers):
    backend: DisaggregatedBackend = cluster_gateway.gateway.backend
    decoders = workers[1:]
    before = sum(w.generation_tokens() for w in decoders)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", cluster_gateway.url + "/v1/completions",
                                                         json=body) as r:
        assert r.status_code == 200
        assert next(r.iter_lines()).startswith("data: {")
    # The workers' load reports (every 0.2 s) show every decode slot and KV block free again.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        workers = backend.decode.live()
        if workers and all(w.num_running == 0 and w.kv_blocks_free == w.kv_blocks_total for w in workers):
            break
        time.sleep(0.05)
    assert all(w.num_running == 0 and w.kv_blocks_free == w.kv_blocks_total for w in backend.decode.live())
    # Had the disconnect not aborted it, the wait above would have lasted until all 480 were generated.
    assert sum(w.generation_tokens() for w in decoders) - before < 480


def test_kvrelay_gateway_command(workers, own_tmp):
    prefill, d1, _ = workers
    gw = GatewayProcess(["--host", "127.0.0.1", "--prefill", prefill.address, "--decode", d1.address],
                        own_tmp / "gateway.log", command="gateway")
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL]  # the id the workers serve
        r = client.completions.create(model=MODEL, prompt="Once", max_tokens=4)
        assert r.usage.completion_tokens == 4
    finally:
        gw.stop()


def test_killed_decode_worker_is_ejected_and_traffic_continues(cluster_gateway, workers):
    backend: DisaggregatedBackend = cluster_gateway.gateway.backend
    victim = workers[2]
    victim.kill()
    t0 = time.monotonic()
    while victim.address in {w.address for w in backend.decode.live()}:
        assert time.monotonic() - t0 < 10
        time.sleep(0.02)
    ejected_after = time.monotonic() - t0
    print(f"\ndecode worker ejected {ejected_after * 1000:.0f} ms after SIGKILL")
    for _ in range(6):
        r = httpx.post(cluster_gateway.url + "/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "Once", "max_tokens": 2})
        assert r.status_code == 200
    assert httpx.get(cluster_gateway.url + "/ready").status_code == 200


def test_serve_disaggregated_hands_kv_over_shared_memory(own_tmp):
    """`kvrelay serve --disaggregated --kv-shm-bytes --kv-shared-cache`: the local decode worker
    keeps an arena and its doorbell socket in /dev/shm while it runs, the prefill worker its KV
    cache (both removed on stop), and it answers like the in-process engine. Its workers run with
    --async-scheduling (handed on as every engine flag is), which changes no token."""
    import asyncio
    from pathlib import Path

    from kvrelay.engine.async_engine import AsyncEngine
    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.engine.sampling_params import SamplingParams

    async def reference() -> str:
        engine = AsyncEngine(EngineArgs())
        try:
            params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
            return "".join([o.text async for o in engine.generate("Once upon a time", params)])
        finally:
            await engine.shutdown()

    want = asyncio.run(reference())
    before = set(Path("/dev/shm").glob("kvrelay-kv-*"))
    gw = GatewayProcess(["--host", "127.0.0.1", "--disaggregated", "--kv-shm-bytes", "8MiB", "--kv-shared-cache",
                         "--async-scheduling"], own_tmp / "serve.log")
    try:
        workers = _children(gw.proc.pid).values()
        assert sum("--async-scheduling" in cmd for cmd in workers) == 2, workers
        arenas = set(Path("/dev/shm").glob("kvrelay-kv-*")) - before  # arena, doorbell socket, prefill cache
        (arena,) = [a for a in arenas if not a.name.endswith(".sock") and a.stat().st_size == 8 << 20]
        (cache,) = arenas - {arena, arena.with_name(arena.name + ".sock")}
        assert cache.stat().st_size > 4096 and not cache.name.endswith(".sock")
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
        r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want
    finally:
        gw.stop()
    deadline = time.monotonic() + 20  # the workers get SIGTERM when serve exits, and stop
    while any(a.exists() for a in arenas):
        assert time.monotonic() < deadline, "the decode worker outlived `kvrelay serve` or left its arena"
        time.sleep(0.1)


def _children(pid: int) -> dict[int, str]:
    """pid -> command line of the processes whose parent is pid."""
    from pathlib import Path

    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if ppid == pid:
            found[int(stat.parent.name)] = cmdline
    return found


def test_serve_disaggregated_exits_when_a_local_worker_cannot_come_back(own_tmp):
    """With no restarts left (here none allowed) `serve --disaggregated` could only answer 503: it stops,
    with exit code 1 and a log line naming the worker, and its prefill worker goes with it."""
    import os
    import signal

    gw = GatewayProcess(["--host", "127.0.0.1", "--disaggregated", "--max-worker-restarts", "0"],
                        own_tmp / "serve.log")
    try:
        workers = _children(gw.proc.pid)
        (decode,) = [pid for pid, cmd in workers.items() if " decode " in cmd]
        (prefill,) = [pid for pid, cmd in workers.items() if " prefill " in cmd]
        os.kill(decode, signal.SIGKILL)
        assert gw.proc.wait(30) == 1
        assert "the local decode worker exited with code -9" in (own_tmp / "serve.log").read_text()
        deadline = time.monotonic() + 20
        while os.path.exists(f"/proc/{prefill}") and "Z" not in _state(prefill):
            assert time.monotonic() < deadline, "the prefill worker outlived `kvrelay serve`"
            time.sleep(0.1)
    finally:
        gw.stop()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_gateway_pairs_a_shared_memory_decode_worker_with_a_prefill_worker_on_its_node(own_tmp):
    """Workers publish their node; a decode worker with an arena gets the prefill worker on its
    node (not the ring's choice), so every hand-off goes through shared memory."""
    started = []
    try:
        for role, *extra in (("prefill", "--node-name", "node-a"), ("prefill", "--node-name", "node-b"),
                             ("decode", "--node-name", "node-b", "--kv-shm-bytes", "8MiB",
                              "--kv-shm-dir", str(own_tmp))):
            started.append(WorkerProcess(role, *extra))
        far, near, decode = started
        backend = DisaggregatedBackend(f"{far.address},{near.address}", decode.address, str(BUNDLED_MODEL))
        gw = InProcessGateway(backend=backend)
        try:
            deadline = time.monotonic() + 30
            while len(backend.prefill.live()) < 2 or not backend.decode.live():
                assert time.monotonic() < deadline, "workers never reported their load"
                time.sleep(0.05)
            (d,) = backend.decode.live()
            assert (d.node, d.kv_shm) == ("node-b", True)
            assert {w.node for w in backend.prefill.live()} == {"node-a", "node-b"}
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
            prompts = [f"Once upon a time there was a {w} who lived in a big {p}"
                       for w in ("cat", "dog", "girl", "boy") for p in ("house", "tree")]
            for prompt in prompts:  # distinct prefixes: the ring alone would spread them over both
                client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
        finally:
            gw.stop()
        accepted = 'kvrelay:kv_shm_offers_total{outcome="accepted"}'
        assert near.metric(accepted) == len(prompts)
        assert far.metric(accepted) == 0 and far.metric('kvrelay:kv_handoffs_total{outcome="ack"}') == 0
    finally:
        for w in started:
            w.stop()


def test_next_turn_goes_back_to_the_decode_worker_holding_the_conversation():
    """A conversation's next turn is routed to the decode worker whose published prefix cache
    holds its earlier turn (not to the least loaded one), and that hand-off moves only the new
    blocks."""
    started = []
    try:
        for role in ("prefill", "decode", "decode"):
            started.append(WorkerProcess(role))
        prefill, d1, d2 = started
        backend = DisaggregatedBackend(prefill.address, f"{d1.address},{d2.address}", str(BUNDLED_MODEL))
        gw = InProcessGateway(backend=backend)
        try:
            deadline = time.monotonic() + 30
            while len(backend.decode.live()) < 2 or not backend.prefill.live():
                assert time.monotonic() < deadline, "workers never reported their load"
                time.sleep(0.05)
            client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
            a_turn1 = list(range(100, 180))  # 5 blocks
            b_turn1 = list(range(300, 380))
            # A keeps one decode worker busy while B's first turn arrives: B goes to the other one.
            a = client.completions.create(model=MODEL, prompt=a_turn1, max_tokens=150, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True})
            a_chunks = iter(a)
            next(a_chunks)
            client.completions.create(model=MODEL, prompt=b_turn1, max_tokens=4, temperature=0)
            list(a_chunks)
            tokens = {w: w.generation_tokens() for w in (d1, d2)}
            b_holder = d1 if tokens[d1] == 4 else d2  # the one that served B only
            assert tokens[b_holder] == 4 and tokens[d1 if b_holder is d2 else d2] == 150
            holder = backend.decode.workers[b_holder.address]
            deadline = time.monotonic() + 10
            while len(holder.cached_blocks) < 5 or holder.load:
                assert time.monotonic() < deadline, "B's blocks never showed in the load stream"
                time.sleep(0.05)
            bytes_before = b_holder.metric("kvrelay:kv_transfer_bytes_total")
            # Both workers are idle now: by load alone B's next turn would go to the first one.
            client.completions.create(model=MODEL, prompt=b_turn1 + list(range(400, 440)), max_tokens=4,
                                      temperature=0)
            assert b_holder.generation_tokens() == 8
            moved = b_holder.metric("kvrelay:kv_transfer_bytes_total") - bytes_before
            assert moved * 5 == bytes_before * 3  # turn 1 moved its 5 blocks; turn 2 only its 3 new ones
        finally:
            gw.stop()
    finally:
        for w in started:
            w.stop()


def test_a_decode_worker_stopped_by_sigterm_finishes_its_streams_first():
    """A rolling update of decode workers: SIGTERM with --shutdown-timeout 60 lets the stream in flight
    end with every token (the worker reports draining meanwhile), then the worker exits 0."""
    import json
    import signal

    prefill, decode = WorkerProcess("prefill"), WorkerProcess("decode", "--shutdown-timeout", "60")
    backend = DisaggregatedBackend(prefill.address, decode.address, str(BUNDLED_MODEL))
    gw = InProcessGateway(backend=backend)
    try:
        deadline = time.monotonic() + 30
        while not backend.decode.live() or not backend.prefill.live():
            assert time.monotonic() < deadline, "workers never reported their load"
            time.sleep(0.05)
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 480, "n": 4, "ignore_eos": True,
                "temperature": 0.0, "stream": True}
        with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=120) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            events = [next(lines)]
            decode.proc.send_signal(signal.SIGTERM)
            events += list(lines)
        assert events[-1] == "data: [DONE]"
        finished = [c for e in events[:-1] for c in json.loads(e[6:])["choices"] if c["finish_reason"]]
        assert sorted(c["finish_reason"] for c in finished) == ["length"] * 4
        assert decode.proc.wait(60) == 0
    finally:
        gw.stop()
        for w in (prefill, decode):
            w.stop()
