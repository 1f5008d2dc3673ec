"""`kvrelay serve` with the engine core in a process of its own: same tokens, typed errors through the
process boundary, disconnects that free KV blocks, and serve exiting non-zero when the engine dies."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from gateway_helpers import GatewayProcess, engine_children
from kvrelay.engine.errors import InvalidRequestError, PromptTooLongError

PROMPT = "Once upon a time"


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def metric(url: str, series: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.rsplit(" ", 1)[0] == series)


@pytest.fixture(scope="module", params=[[], ["--async-scheduling"]], ids=["sync", "async-scheduling"])
def serve(request, tmp_path_factory):
    gw = GatewayProcess(request.param, tmp_path_factory.mktemp("serve") / "serve.log")
    yield gw
    gw.stop()


def test_errors_keep_their_fields_across_the_process_boundary():
    e = pickle.loads(pickle.dumps(PromptTooLongError("prompt: 600 tokens, limit 512", 600, 512)))
    assert (type(e), e.field, e.num_tokens, e.limit) == (PromptTooLongError, "prompt", 600, 512)
    e = pickle.loads(pickle.dumps(InvalidRequestError("max_tokens: must be at least 1", field="max_tokens")))
    assert (type(e), e.field, str(e)) == (InvalidRequestError, "max_tokens", "max_tokens: must be at least 1")


def test_the_engine_runs_in_its_own_process_and_gives_the_in_process_tokens(serve):
    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.engine.llm_engine import LLMEngine
    from kvrelay.engine.sampling_params import SamplingParams

    assert len(engine_children(serve.proc.pid)) == 1
    client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused")
    got = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=40, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="stories260K", prompt=PROMPT, max_tokens=40, temperature=0, stream=True))
    engine = LLMEngine(EngineArgs())
    engine.add_request(PROMPT, SamplingParams(max_tokens=40, temperature=0), "r")
    want = ""
    while engine.has_work():
        want += "".join(o.text for o in engine.step())
    assert got.choices[0].text == streamed == want
    n3 = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3, n=3)
    assert sorted(c.index for c in n3.choices) == [0, 1, 2] and n3.usage.completion_tokens == 24


def test_engine_errors_are_400s_naming_the_field(serve):
    client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="stories260K", prompt="word " * 2000, max_tokens=4)
    assert e.value.body["param"] == "prompt"
    assert client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_a_client_that_disconnects_frees_its_blocks(serve):
    body = {"model": "stories260K", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", serve.url + "/v1/completions", json=body, timeout=30) as r:
        chunks = r.iter_lines()
        for _ in range(3):
            next(chunks)
        deadline = time.monotonic() + 10
        while metric(serve.url, 'kvrelay:num_requests_running{model="stories260K"}') < 1:
            assert time.monotonic() < deadline, "the request never showed as running"
            time.sleep(0.05)
    deadline = time.monotonic() + 10  # closed: the engine drops it in its next step
    while (metric(serve.url, 'kvrelay:num_requests_running{model="stories260K"}') > 0
           or metric(serve.url, 'kvrelay:kv_cache_usage_perc{model="stories260K"}') > 0):
        assert time.monotonic() < deadline, "the disconnected request still holds KV blocks"
        time.sleep(0.05)


def test_serve_exits_non_zero_when_the_engine_process_dies(tmp_path):
    gw = GatewayProcess([], tmp_path / "serve.log")
    try:
        (child,) = engine_children(gw.proc.pid)
        os.kill(child, signal.SIGKILL)
        assert gw.proc.wait(15) != 0
        log = (tmp_path / "serve.log").read_text()
        assert "engine worker exited with code -9" in log and "Traceback" not in log
    finally:
        gw.stop()


def test_a_model_that_cannot_load_is_one_line_and_serve_exits(tmp_path):
    bad = tmp_path / "not-a-model"
    bad.mkdir()
    out = subprocess.run([sys.executable, "-m", "kvrelay.cli", "serve", "--model", str(bad), "--port", "0"],
                         check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "the engine could not start" in out.stderr


def test_ctrl_c_to_the_process_group_stops_serve_and_its_engine_cleanly(tmp_path):
    gw = GatewayProcess([], tmp_path / "serve.log")
    try:
        (child,) = engine_children(gw.proc.pid)
        for pid in (child, gw.proc.pid):  # what a terminal's Ctrl+C does: SIGINT to the whole group
            os.kill(pid, signal.SIGINT)
        assert gw.proc.wait(20) == 0
        deadline = time.monotonic() + 10
        while alive(child):
            assert time.monotonic() < deadline, "the engine process outlived serve"
            time.sleep(0.05)
        log = (tmp_path / "serve.log").read_text()
        assert "Traceback" not in log and "exited with code" not in log
    finally:
        gw.stop()


def test_moe_expert_load_crosses_the_process_boundary(tmp_path):
    """EngineStats' expert-load reader is a callable in one process; serve gets a snapshot of it."""
    import sys as _sys

    _sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
    from tiny_models import save_tiny_model

    model = save_tiny_model(tmp_path / "mixtral", "mixtral")
    gw = GatewayProcess(["--model", str(model)], tmp_path / "serve.log")
    try:
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused")
        client.completions.create(model="mixtral", prompt=PROMPT, max_tokens=4, temperature=0)
        deadline = time.monotonic() + 10
        while metric(gw.url, 'kvrelay:moe_expert_load_imbalance{window="total"}') < 1:
            assert time.monotonic() < deadline, "no expert load on serve's /metrics"
            time.sleep(0.1)
    finally:
        gw.stop()
