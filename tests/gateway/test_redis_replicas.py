"""Quotas shared by gateway replicas (separate `kvrelay serve` processes) through a real Redis."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
import pytest
from gateway_helpers import GatewayProcess, RedisServer, write_tenants
from kvrelay.gateway.quota import RedisQuotaStore
from kvrelay.gateway.tenants import hash_key

MODEL = "stories260K"
LEASE_TTL = 2.0
TENANTS = [
    {"id": "rpm50", "api_keys_sha256": [hash_key("k-rpm50")], "quotas": {"requests_per_minute": 50}},
    {"id": "budget", "api_keys_sha256": [hash_key("k-budget")],
     "quotas": {"tokens_per_minute": 1_000_000, "tokens_per_day": 5_000_000}},
    {"id": "conc2", "api_keys_sha256": [hash_key("k-conc2")], "quotas": {"concurrent_requests": 2}},
    {"id": "burst", "api_keys_sha256": [hash_key("k-burst")], "quotas": {"requests_per_minute": 60}},
    {"id": "steady", "api_keys_sha256": [hash_key("k-steady")], "quotas": {"requests_per_minute": 100_000}},
]


@pytest.fixture(scope="module")
def cluster(own_tmp):
    tmp = own_tmp
    redis = RedisServer()
    redis.start()
    tenants = write_tenants(tmp / "tenants.yaml", TENANTS)
    common = ["--redis-url", redis.url, "--tenants", tenants, "--lease-ttl", str(LEASE_TTL)]
    gateways = []
    try:
        gateways.append(GatewayProcess(common + ["--quota-failure-policy", "closed"], tmp / "gw0.log"))
        gateways.append(GatewayProcess(common + ["--quota-failure-policy", "open"], tmp / "gw1.log"))
        yield redis, gateways, common, tmp
    finally:
        for g in gateways:
            g.stop()
        redis.stop()


def usage(redis_url: str, tenant: str) -> dict[str, int]:
    async def read():
        store = RedisQuotaStore(redis_url)
        try:
            return await store.usage(tenant)
        finally:
            await store.close()

    return asyncio.run(read())


def test_200_concurrent_requests_across_two_replicas_admit_exactly_50(cluster):
    redis, gateways, _, _ = cluster

    async def burst():
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        async with httpx.AsyncClient(timeout=120, limits=limits, headers={"x-api-key": "k-rpm50"}) as http:
            body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2}
            return await asyncio.gather(*(http.post(gateways[i % 2].url + "/v1/completions", json=body)
                                          for i in range(200)))

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    assert statuses.count(200) == 50 and statuses.count(429) == 150, statuses
    ok = [r.json() for r in responses if r.status_code == 200]
    assert all(b["usage"]["completion_tokens"] == 2 for b in ok)  # admitted requests really ran
    # Each replica answered 100 requests: had they counted separately, 100 would have passed.
    assert sorted(Counter(r.url.port for r in responses).values()) == [100, 100]
    rejected = [r for r in responses if r.status_code == 429]
    assert all(r.json()["error"]["code"] == "requests_per_minute" and "retry-after" in r.headers for r in rejected)
    assert usage(redis.url, "rpm50")["requests_per_minute"] == 50


def test_400_concurrent_requests_queue_for_redis_connections_and_admit_exactly_60(cluster):
    """More concurrent admissions than Redis connections (64 per gateway, 200 requests each): the
    surplus waits for a connection. A full pool used to read as "Redis unavailable": 503s under the
    closed policy (gateway 0) and unaccounted admissions under the open one (gateway 1)."""
    redis, gateways, _, _ = cluster

    async def burst():
        limits = httpx.Limits(max_connections=500, max_keepalive_connections=500)
        async with httpx.AsyncClient(timeout=120, limits=limits, headers={"x-api-key": "k-burst"}) as http:
            body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1}
            return await asyncio.gather(*(http.post(gateways[i % 2].url + "/v1/completions", json=body)
                                          for i in range(400)))

    statuses = Counter(r.status_code for r in asyncio.run(burst()))
    assert statuses == {200: 60, 429: 340}, statuses
    assert usage(redis.url, "burst")["requests_per_minute"] == 60


def test_token_budget_reconciles_exactly_after_mixed_streams(cluster):
    redis, gateways, _, _ = cluster
    requests = []
    for i in range(24):
        body = {"model": MODEL, "prompt": ["Once upon a time", "The cat", "Lily went to the"][i % 3],
                "max_tokens": [1, 7, 40, 120][i % 4], "stream": True, "stream_options": {"include_usage": True},
                "temperature": 1.0, "seed": i}
        if i % 5 == 0:
            body["stop"] = [" the", "."]  # ends early: most of the reservation is refunded
        requests.append((gateways[i % 2], body))

    async def run_all():
        async with httpx.AsyncClient(timeout=120, headers={"x-api-key": "k-budget"}) as http:
            async def one(gw, body):
                total = None
                async with http.stream("POST", gw.url + "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: {") and '"usage":{' in line:
                            import json

                            total = json.loads(line[6:])["usage"]["total_tokens"]
                return total

            return await asyncio.gather(*(one(gw, body) for gw, body in requests))

    totals = asyncio.run(run_all())
    assert None not in totals
    u = usage(redis.url, "budget")
    assert u["tokens_per_minute"] == sum(totals)
    assert u["tokens_per_day"] == sum(totals)
    assert u["concurrent_requests"] == 0
    assert sum(totals) < sum(b["max_tokens"] for _, b in requests)  # refunds really happened


def test_killed_gateway_frees_its_concurrency_leases(cluster):
    redis, gateways, common, tmp = cluster
    doomed = GatewayProcess(common, tmp / "doomed.log")
    try:
        # ~10 MB of events that the client never reads: the gateway blocks on backpressure, so the
        # requests are certainly still in flight (holding their leases) when it is killed.
        body = {"model": MODEL, "prompt": "Once", "max_tokens": 450, "ignore_eos": True, "stream": True,
                "n": 16, "logprobs": 20}
        headers = {"x-api-key": "k-conc2"}
        clients = [httpx.Client(timeout=30, headers=headers) for _ in range(2)]
        held = []  # keep every stream object referenced: collecting one would close its connection
        for c in clients:
            stream = c.stream("POST", doomed.url + "/v1/completions", json=body)
            r = stream.__enter__()
            assert r.status_code == 200
            lines = r.iter_lines()
            next(lines)  # the request is running: its lease is held
            held.append((stream, r, lines))
        doomed.kill()
        for c in clients:
            c.close()
    finally:
        doomed.stop()
    assert usage(redis.url, "conc2")["concurrent_requests"] == 2
    small = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    r = httpx.post(gateways[0].url + "/v1/completions", json=small, headers=headers, timeout=30)
    assert r.status_code == 429 and r.json()["error"]["code"] == "concurrent_requests"
    deadline = time.monotonic() + LEASE_TTL + 10
    while r.status_code == 429 and time.monotonic() < deadline:
        time.sleep(0.2)
        r = httpx.post(gateways[0].url + "/v1/completions", json=small, headers=headers, timeout=30)
    assert r.status_code == 200
    # Live requests keep their leases beyond the TTL (the surviving gateway renews them).
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 1}
    assert httpx.post(gateways[1].url + "/v1/completions", json=body, headers=headers, timeout=30).status_code == 200


def test_redis_down_applies_policy_and_recovers(cluster):
    redis, gateways, _, _ = cluster
    closed, opened = gateways
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    headers = {"x-api-key": "k-steady"}
    assert httpx.post(closed.url + "/v1/completions", json=body, headers=headers, timeout=30).status_code == 200
    redis.stop()
    try:
        r = httpx.post(closed.url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "quota_store_unavailable"
        assert httpx.post(opened.url + "/v1/completions", json=body, headers=headers, timeout=30).status_code == 200
        for g in gateways:
            assert httpx.get(g.url + "/health", timeout=5).status_code == 200
            assert g.proc.poll() is None
    finally:
        redis.start()
    deadline = time.monotonic() + 15
    r = httpx.post(closed.url + "/v1/completions", json=body, headers=headers, timeout=30)
    while r.status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
        r = httpx.post(closed.url + "/v1/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == 200
    assert usage(redis.url, "steady")["requests_per_minute"] >= 1  # accounted in Redis again
