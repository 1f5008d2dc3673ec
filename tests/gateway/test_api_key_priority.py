"""`--api-key` (one key, constant-time compare, never logged) and per-request `priority` bounded by
the tenant's allowance."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import openai
import pytest
from gateway_helpers import GatewayProcess, InProcessGateway, write_tenants
from kvrelay.gateway.api_key import ApiKeyRegistry
from kvrelay.gateway.app import GatewayConfig
from kvrelay.gateway.scheduler import FairScheduler
from kvrelay.gateway.tenants import hash_key
from test_fairness import serve_in_order

KEY = "sk-test-4f1c2a9e7d"


def test_serve_with_api_key(own_tmp):
    gw = GatewayProcess(["--api-key", KEY], own_tmp / "apikey.log")
    try:
        body = {"model": "stories260K", "prompt": "Once", "max_tokens": 2}
        assert httpx.post(gw.url + "/v1/completions", json=body).status_code == 401
        bad = httpx.post(gw.url + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-wrong"})
        assert bad.status_code == 401 and KEY not in bad.text
        good = openai.OpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
        assert good.completions.create(**body).usage.completion_tokens == 2
        assert httpx.get(gw.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
        # serve runs the engine in a process of its own: constraints and prompt logprobs cross it.
        r = good.completions.create(model="stories260K", prompt="Once", max_tokens=20, temperature=1.0, seed=1,
                                    extra_body={"guided_regex": "(cat|dog) [0-9]{2}"})
        assert re.fullmatch("(cat|dog) [0-9]{2}", r.choices[0].text)
        scored = good.completions.create(model="stories260K", prompt="Once upon a time", echo=True, logprobs=0,
                                         max_tokens=0).choices[0].logprobs
        assert scored.token_logprobs[0] is None and all(v < 0 for v in scored.token_logprobs[1:])
    finally:
        gw.stop()
    assert KEY not in (own_tmp / "apikey.log").read_text()


def test_api_key_and_tenants_file_exclude_each_other(own_tmp):
    tenants = write_tenants(own_tmp / "t.yaml", [{"id": "a", "api_keys_sha256": [hash_key("k")]}])
    r = subprocess.run([sys.executable, "-m", "kvrelay.cli", "serve", "--api-key", KEY, "--tenants", tenants],
                       check=False, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--api-key and --tenants exclude each other" in r.stderr and KEY not in r.stderr


def test_api_key_registry_compares_hashes_only():
    reg = ApiKeyRegistry(KEY)
    assert reg.authenticate(KEY).id == "default"
    assert reg.authenticate(KEY + "x") is None and reg.authenticate(None) is None
    assert KEY not in repr(reg) and not reg.open
    with pytest.raises(ValueError):
        ApiKeyRegistry(" padded ")


async def test_a_high_priority_request_overtakes_its_own_tenant_only():
    sched = FairScheduler(capacity=1, max_queue=100)
    blocker = sched.submit("a", 0, 10)
    a_low = [sched.submit("a", 0, 10, rank=0) for _ in range(3)]
    b = [sched.submit("b", 0, 10) for _ in range(2)]
    a_high = sched.submit("a", 0, 10, rank=5)
    vip = sched.submit("vip", 1, 10)  # a higher band
    sched.release(blocker, 10)
    order = await serve_in_order(sched, [*a_low, *b, a_high, vip])
    assert order[0] is vip  # no request priority lifts tenant a over a higher band
    a_order = [t for t in order if t.tenant_id == "a"]
    assert a_order == [a_high, *a_low]  # its own high-priority request goes first, then FIFO
    assert [t.tenant_id for t in order[1:5]] == ["a", "b", "a", "b"]  # fairness between tenants unchanged


def test_request_priority_is_capped_by_the_tenant(own_tmp):
    tenants = write_tenants(own_tmp / "prio.yaml", [
        {"id": "capped", "api_keys_sha256": [hash_key("kc")], "priority": 0},
        {"id": "trusted", "api_keys_sha256": [hash_key("kt")], "priority": 0, "max_request_priority": 10}])
    gw = InProcessGateway(tenants_file=tenants, config=GatewayConfig())
    seen = []
    original = gw.gateway.backend.generate

    def spy(prompt, params, request_id, priority=0, cache_salt=None):
        seen.append(priority)
        return original(prompt, params, request_id, priority, cache_salt)

    gw.gateway.backend.generate = spy
    try:
        for key, priority in (("kc", 50), ("kc", -3), ("kt", 50), ("kt", 7)):
            r = httpx.post(gw.url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                           json={"model": "stories260K", "prompt": "A", "max_tokens": 1, "priority": priority})
            assert r.status_code == 200, r.text
        assert seen == [0, -3, 10, 7]  # what the engine's priority policy sees: capped at the allowance
        r = httpx.post(gw.url + "/v1/completions", headers={"Authorization": "Bearer kt"},
                       json={"model": "stories260K", "prompt": "A", "max_tokens": 1, "priority": 10**6})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    finally:
        gw.stop()
