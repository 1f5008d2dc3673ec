"""The OpenAI-compatible API through the official `openai` client, against a real server."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import httpx
import openai
import pytest

MODEL = "stories260K"


@pytest.fixture(scope="module")
def client(open_gateway):
    return openai.OpenAI(base_url=open_gateway.url + "/v1", api_key="unused", max_retries=0)


def test_models(client, open_gateway):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    one = client.models.retrieve(MODEL)
    assert (one.id, one.model_extra["max_model_len"]) == (MODEL, 512)
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("org/other-model")
    assert e.value.body["code"] == "model_not_found" and MODEL in e.value.body["message"]
    from kvrelay import __version__

    assert httpx.get(open_gateway.url + "/version").json() == {"version": __version__}


def test_completion_not_streaming(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_streaming_matches_non_streaming_and_reports_usage(client):
    kwargs = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 20, "temperature": 0}
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_not_streaming_and_streaming(client):
    msgs = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "A cat"}]
    whole = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=10, temperature=0)
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens == 10
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens


def test_stop_string(client):
    base = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0)
    text = base.choices[0].text
    stop = text[10:14]
    assert stop.strip(), text
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=30, temperature=0, stop=stop)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]


def test_seed_makes_sampling_reproducible(client):
    kwargs = {"model": MODEL, "prompt": "The dog", "max_tokens": 25, "temperature": 1.0, "seed": 1234}
    a = client.completions.create(**kwargs).choices[0].text
    b = client.completions.create(**kwargs).choices[0].text
    assert a == b
    texts = {client.completions.create(**{**kwargs, "seed": s}).choices[0].text for s in range(5)}
    assert len(texts) > 1  # the seed really changes the samples


def test_logprobs_completion_and_chat(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 6 == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(x <= 0 for x in lp.token_logprobs) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    # greedy: the chosen token is the best alternative
    assert all(abs(max(t.values()) - x) < 1e-5 for t, x in zip(lp.top_logprobs, lp.token_logprobs))
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)


def test_n_and_batched_prompts(client):
    r = client.completions.create(model=MODEL, prompt="A", max_tokens=5, n=3, temperature=1.0, seed=3)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 15
    r = client.completions.create(model=MODEL, prompt=["A dog", "A cat"], max_tokens=4, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1]
    single = client.completions.create(model=MODEL, prompt="A cat", max_tokens=4, temperature=0)
    assert r.choices[1].text == single.choices[0].text


def test_error_statuses_through_the_client(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, temperature=7)
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="word " * 600, max_tokens=1)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_completion_tokens=600)
    assert e.value.body["param"] == "messages"


def test_logit_bias_forces_a_token_and_bad_maps_are_400(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0,
                                  logit_bias={"300": 100}, logprobs=0)
    tok = r.choices[0].logprobs.tokens
    assert len(tok) == 6 and len(set(tok)) == 1  # token 300, six times
    plain = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert plain.choices[0].text != r.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logit_bias={"300": 100}, logprobs=True)
    assert {c.token for c in chat.choices[0].logprobs.content} == {tok[0]}
    for bad in ({"abc": 1}, {"99999": 1}, {"5": 250}, {"1" * 40: 1}):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1, logit_bias=bad)
        assert e.value.body["param"].startswith("logit_bias"), bad


def test_echo_puts_the_prompt_before_the_completion(client):
    kwargs = {"model": MODEL, "max_tokens": 8, "temperature": 0}
    plain = client.completions.create(prompt="Once upon a time", **kwargs).choices[0].text
    echoed = client.completions.create(prompt="Once upon a time", echo=True, **kwargs)
    assert echoed.choices[0].text == "Once upon a time" + plain
    assert echoed.usage.completion_tokens == 8
    stream = client.completions.create(prompt="Once upon a time", echo=True, stream=True, **kwargs)
    assert "".join(c.choices[0].text for c in stream if c.choices) == "Once upon a time" + plain
    two = client.completions.create(prompt=["Lily", "Tom"], echo=True, n=2, **kwargs)
    texts = [c.text for c in sorted(two.choices, key=lambda c: c.index)]
    assert [t[:3] for t in texts] == ["Lil", "Lil", "Tom", "Tom"]  # choices i*n..i*n+n-1 belong to prompt i
    # With logprobs, the prompt's tokens lead the lists (test_evaluation_api.py checks their values).
    scored = client.completions.create(prompt="x", echo=True, logprobs=1, **kwargs).choices[0].logprobs
    assert scored.token_logprobs[0] is None and len(scored.tokens) == len(scored.token_logprobs) > 8


def test_disconnect_aborts_and_frees_kv_blocks(open_gateway):
    engine = open_gateway.engine
    total = engine.stats().kv_blocks_total
    before = engine.stats().generation_tokens_total
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 450, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", open_gateway.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert next(r.iter_lines()).startswith("data: {")  # generating: the first token arrived
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.num_running == 0 and s.num_waiting == 0 and s.kv_blocks_free == total:
            break
        time.sleep(0.02)
    s = engine.stats()
    assert (s.num_running, s.kv_blocks_free) == (0, total)
    # The request ended early: far fewer than 450 tokens were generated.
    assert s.generation_tokens_total - before < 450


def test_non_streaming_disconnect_aborts(open_gateway):
    engine = open_gateway.engine
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 480, "ignore_eos": True}
    before = engine.stats().generation_tokens_total
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(open_gateway.url + "/v1/completions", json=body, timeout=0.05)
    deadline = time.monotonic() + 10
    while engine.stats().num_running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert engine.stats().num_running == 0
    assert engine.stats().generation_tokens_total - before < 480


def test_health_ready_metrics_pass_promtool(open_gateway, client):
    assert httpx.get(open_gateway.url + "/health").json() == {"status": "ok"}
    assert httpx.get(open_gateway.url + "/ready").status_code == 200
    client.completions.create(model=MODEL, prompt="x", max_tokens=2)
    text = httpx.get(open_gateway.url + "/metrics").text
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "num_requests_waiting", "num_requests_running",
                 "prompt_tokens_total", "generation_tokens_total", "quota_rejections", "gateway_queue_depth"):
        assert f"kvrelay:{name}" in text, name
    assert 'kvrelay:gateway_queue_depth{model="stories260K",role="engine"} 0.0' in text
    if shutil.which("promtool") is None:
        pytest.fail("promtool is not installed: run scripts/ci.d/20-promtool.sh")
    check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, check=False)
    problems = [line for line in (check.stdout + check.stderr).splitlines() if line.strip()]
    # The `kvrelay:` prefix (vLLM's naming, which dashboards expect) is the one lint promtool
    # raises: colons are reserved for recording rules. Anything else fails the test.
    unexpected = [p for p in problems if not p.endswith("metric names should not contain ':'")]
    assert unexpected == [], unexpected
    assert json.dumps(problems)  # at least parsed


def test_cors_lets_the_allowed_origins_read_every_answer():
    """--allowed-origins: a browser page of an allowed origin passes the preflight and reads answers,
    errors included; another origin gets no CORS headers; without the flag there are none."""
    from gateway_helpers import InProcessGateway
    from kvrelay.gateway.gateway import GatewayConfig

    allowed, other = "https://app.example", "https://evil.example"
    gw = InProcessGateway(config=GatewayConfig(allowed_origins=[allowed]))
    try:
        preflight = {"access-control-request-method": "POST",
                     "access-control-request-headers": "authorization,content-type"}
        r = httpx.options(gw.url + "/v1/chat/completions", headers={"origin": allowed, **preflight})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == allowed
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        assert "access-control-allow-origin" not in httpx.options(
            gw.url + "/v1/chat/completions", headers={"origin": other, **preflight}).headers
        ok = httpx.post(gw.url + "/v1/completions", headers={"origin": allowed},
                        json={"model": MODEL, "prompt": "Once", "max_tokens": 2})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == allowed
        assert "x-request-id" in ok.headers["access-control-expose-headers"]
        bad = httpx.post(gw.url + "/v1/completions", headers={"origin": allowed}, json={"model": MODEL})
        assert bad.status_code == 400 and bad.headers["access-control-allow-origin"] == allowed
    finally:
        gw.stop()


def test_without_allowed_origins_there_are_no_cors_headers(open_gateway):
    r = httpx.post(open_gateway.url + "/v1/completions", headers={"origin": "https://app.example"},
                   json={"model": MODEL, "prompt": "Once", "max_tokens": 2})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
