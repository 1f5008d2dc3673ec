"""Tenants, auth and every error path: OpenAI error bodies with the right status, never a 500."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from gateway_helpers import InProcessGateway, write_tenants
from kvrelay.gateway.app import GatewayConfig
from kvrelay.gateway.tenants import hash_key

MODEL = "stories260K"


@pytest.fixture(scope="module")
def tenants_path(own_tmp):
    path = own_tmp / "tenants.yaml"
    write_tenants(path, [
        {"id": "acme", "api_keys_sha256": [hash_key("sk-acme")], "quotas": {"requests_per_minute": 1000}},
        {"id": "limited", "api_keys_sha256": [hash_key("sk-limited")], "quotas": {"requests_per_minute": 2}},
        {"id": "other-model", "api_keys_sha256": [hash_key("sk-other")], "allowed_models": ["llama"]},
        {"id": "tiny", "api_keys_sha256": [hash_key("sk-tiny")], "quotas": {"tokens_per_minute": 50}},
    ])
    return path


@pytest.fixture(scope="module")
def gw(tenants_path):
    g = InProcessGateway(str(tenants_path), GatewayConfig(max_body_bytes=64 * 1024, capacity=1, max_queue=1))
    yield g
    g.stop()


def post(gw, body, key="sk-acme", path="/v1/completions", **kw):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    if body is not None:
        kw["json"] = body
    return httpx.post(gw.url + path, headers=headers | kw.pop("headers", {}), timeout=30, **kw)


def assert_error(r, status, param=None, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def test_auth_statuses(gw):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    assert_error(post(gw, body, key=None), 401)
    err = assert_error(post(gw, body, key="sk-wrong"), 401)
    assert "sk-wrong" not in err["message"]
    assert post(gw, body, key=None, headers={"x-api-key": "sk-acme"}).status_code == 200
    assert_error(post(gw, body, key="sk-other"), 403, "model")
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-other", max_retries=0)
    with pytest.raises(openai.PermissionDeniedError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert client.models.list().data == []
    with pytest.raises(openai.PermissionDeniedError):
        client.models.retrieve(MODEL)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gw.url + "/v1", api_key="nope", max_retries=0).models.retrieve(MODEL)


def test_rate_limit_429_with_headers_via_client(gw):
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-limited", max_retries=0)
    ok = client.completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=1)
    assert ok.headers["x-ratelimit-limit-requests"] == "2"
    assert ok.headers["x-ratelimit-remaining-requests"] == "1"
    client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    headers = e.value.response.headers
    assert 1 <= int(headers["retry-after"]) <= 60
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert e.value.body["code"] == "requests_per_minute"
    # The API port's /metrics needs a key here (a tenants file is loaded) and sums over tenants.
    assert httpx.get(gw.url + "/metrics").status_code == 401
    metrics = httpx.get(gw.url + "/metrics", headers={"x-api-key": "sk-acme"}).text
    assert 'kvrelay:quota_rejections_total{limit="requests_per_minute"} 1.0' in metrics
    assert "sk-limited" not in metrics and 'tenant="limited"' not in metrics


def test_request_larger_than_token_quota_is_400(gw):
    r = post(gw, {"model": MODEL, "prompt": "x", "max_tokens": 100}, key="sk-tiny")
    assert_error(r, 400, "max_tokens", "request_exceeds_quota")


def test_queue_full_is_503_and_queued_request_runs(gw):
    """capacity 1 and max_queue 1: one runs, one waits, the third is turned away."""

    async def scenario():
        async with httpx.AsyncClient(timeout=60, headers={"authorization": "Bearer sk-acme"}) as http:
            long = {"model": MODEL, "prompt": "Once", "max_tokens": 500, "ignore_eos": True}
            first = asyncio.create_task(http.post(gw.url + "/v1/completions", json=long))
            deadline = time.monotonic() + 60
            while gw.gateway.scheduler.inflight == 0:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.002)
            second = asyncio.create_task(http.post(gw.url + "/v1/completions", json=long | {"max_tokens": 2}))
            while gw.gateway.scheduler.depth == 0:
                assert time.monotonic() < deadline and not first.done(), "the first request ended too soon"
                await asyncio.sleep(0.002)
            metrics = (await http.get(gw.url + "/metrics")).text
            third = await http.post(gw.url + "/v1/completions", json=long | {"max_tokens": 2})
            return await first, await second, third, metrics

    first, second, third, metrics = asyncio.run(scenario())
    assert first.status_code == 200 and second.status_code == 200
    assert 'kvrelay:gateway_queue_depth{model="stories260K",role="engine"} 1.0' in metrics
    assert_error(third, 503, code="queue_full")


def test_body_too_large_is_413(gw):
    assert_error(post(gw, {"model": MODEL, "prompt": "a" * 100_000}), 413)

    def chunks():  # no content-length: the limit is enforced while reading
        for _ in range(20):
            yield b" " * 8192
        yield b'{"model": "x"}'

    assert_error(post(gw, None, content=chunks()), 413)


BAD_BODIES = [
    (b'{"model": "stories260K", "prompt": ', None),  # malformed JSON
    (b'[1, 2, 3]', None),
    (b'"just a string"', None),
    (b'{"model": "stories260K", "prompt": "x", "max_tokens": "10"}', "max_tokens"),
    (b'{"model": "stories260K", "prompt": "x", "max_tokens": -1}', "max_tokens"),
    (b'{"model": "stories260K", "prompt": "x", "max_tokens": 1e400}', "max_tokens"),
    (b'{"model": "stories260K", "prompt": "x", "temperature": NaN}', "temperature"),
    (b'{"model": "stories260K", "prompt": "x", "temperature": Infinity}', "temperature"),
    (b'{"model": "stories260K", "prompt": "x", "n": 1000000000}', "n"),
    (b'{"model": "stories260K", "prompt": "x", "logprobs": 99}', "logprobs"),
    (b'{"model": "stories260K", "prompt": "x", "top_p": 0}', "top_p"),
    (b'{"model": "stories260K", "prompt": "x", "stop": ["a", 3]}', "stop"),
    (b'{"model": "stories260K", "prompt": "x", "max_token": 5}', "max_token"),  # unknown field
    (b'{"model": "stories260K", "prompt": "x", "stream": "yes"}', "stream"),
    (b'{"model": "stories260K", "prompt": "x", "seed": 123456789012345678901234567890}', "seed"),
    (b'{"model": "stories260K", "prompt": []}', "prompt"),
    (b'{"model": "stories260K", "prompt": [1, 99999]}', "prompt"),
    (b'{"model": "stories260K", "prompt": [1, -5]}', "prompt"),
    (b'{"model": "stories260K", "prompt": "\\ud800 lone surrogate"}', "prompt"),
    (b'{"model": "stories260K", "prompt": "x", "stop": "\\udfff"}', "stop"),
    (b'{"model": "stories260K", "prompt": "\xff\xfe invalid utf-8"}', None),
    (b'{"model": 5, "prompt": "x"}', "model"),
    (b'{"prompt": "x"}', "model"),
]


@pytest.mark.parametrize("raw,param", BAD_BODIES)
def test_bad_completion_bodies_are_400_naming_the_field(gw, raw, param):
    r = post(gw, None, content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400, param)


BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 3}, "presence_penalty"),
]


@pytest.mark.parametrize("extra,param", BAD_CHAT)
def test_bad_chat_bodies(gw, extra, param):
    import json

    raw = json.dumps({"model": MODEL} | extra).encode()  # json.dumps escapes the lone surrogate
    r = post(gw, None, content=raw, path="/v1/chat/completions", headers={"content-type": "application/json"})
    assert_error(r, 400, param)


def test_an_image_for_a_text_only_model_is_named(gw):
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "http://x"}}]
    r = post(gw, {"model": MODEL, "messages": [{"role": "user", "content": content}]}, path="/v1/chat/completions")
    err = assert_error(r, 400, "messages[0].content[1]")
    assert "takes text only" in err["message"], err["message"]


def test_an_audio_part_is_named_as_unsupported(gw):
    content = [{"type": "text", "text": "Hear this"}, {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]
    r = post(gw, {"model": MODEL, "messages": [{"role": "user", "content": content}]}, path="/v1/chat/completions")
    err = assert_error(r, 400, "messages[0].content")
    assert err["message"].startswith("messages[0].content: part 1 has type 'input_audio'"), err["message"]


def test_unknown_route_and_method(gw):
    assert_error(httpx.get(gw.url + "/v1/nothing"), 404)
    assert_error(httpx.get(gw.url + "/v1/completions"), 405)


def test_tenants_file_reloads_without_restart(gw, tenants_path):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    assert post(gw, body, key="sk-new").status_code == 401
    text = tenants_path.read_text()
    tenants_path.write_text(text + f"- id: newcomer\n  api_keys_sha256: ['{hash_key('sk-new')}']\n")
    deadline = time.monotonic() + 5
    while post(gw, body, key="sk-new").status_code == 401 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert post(gw, body, key="sk-new").status_code == 200
    tenants_path.write_text("tenants: [this is: not valid")  # a broken edit keeps the old tenants
    time.sleep(1.2)
    assert post(gw, body, key="sk-new").status_code == 200
    tenants_path.write_text(text)


def test_empty_json_key_is_a_400_not_a_500(gw):
    err = assert_error(post(gw, {"model": MODEL, "prompt": "hi", "": 1}), 400, param='""')
    assert "unknown field" in err["message"]


def test_integral_floats_are_accepted_for_integer_fields(gw):
    r = post(gw, {"model": MODEL, "prompt": "Once", "max_tokens": 4.0, "n": 1.0, "seed": 7.0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
    assert_error(post(gw, {"model": MODEL, "prompt": "Once", "max_tokens": 4.5}), 400, param="max_tokens")
    assert_error(post(gw, {"model": MODEL, "prompt": "Once", "max_tokens": True}), 400, param="max_tokens")


def test_405_names_the_allowed_methods(gw):
    r = httpx.get(gw.url + "/v1/completions", timeout=30)
    assert_error(r, 405, code="method_not_allowed")
    assert r.headers["allow"] == "POST"
