"""No charge without service: the quota ledger after a stalled Redis and after a killed gateway.

Each test owns its redis-server (on a free port) so it can freeze or restart it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time

import httpx
import redis
from gateway_helpers import GatewayProcess, InProcessGateway, write_tenants
from kvrelay.gateway.app import GatewayConfig
from kvrelay.gateway.quota import QuotaManager, RedisQuotaStore
from kvrelay.gateway.tenants import hash_key

MODEL = "stories260K"


def usage(redis_url: str, tenant: str) -> dict[str, int]:
    async def read():
        store = RedisQuotaStore(redis_url)
        try:
            return await store.usage(tenant)
        finally:
            await store.close()

    return asyncio.run(read())


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_redis_frozen_during_admissions_takes_nothing_when_it_resumes(redis_server, own_tmp):
    tenants = write_tenants(own_tmp / "stall.yaml", [
        {"id": "stall", "api_keys_sha256": [hash_key("k-stall")],
         "quotas": {"concurrent_requests": 10, "tokens_per_day": 100_000}}])
    quota = QuotaManager(RedisQuotaStore(redis_server.url, timeout_s=0.3), lease_ttl_s=60)
    gw = InProcessGateway(tenants, GatewayConfig(lease_ttl_s=60), quota=quota)
    headers = {"x-api-key": "k-stall"}
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40}
    try:
        os.kill(redis_server.proc.pid, signal.SIGSTOP)
        try:
            async def six():
                async with httpx.AsyncClient(timeout=60, headers=headers) as http:
                    return await asyncio.gather(*(http.post(gw.url + "/v1/completions", json=body)
                                                  for _ in range(6)))

            responses = asyncio.run(six())
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        assert [r.status_code for r in responses] == [503] * 6
        assert all(r.json()["error"]["code"] == "quota_store_unavailable" for r in responses)
        # Redis now runs the admissions it had queued: each finds its deadline passed. The gateway
        # voids them too (their answers were lost), once Redis answers again.
        wait_for(lambda: gw.gateway.quota.pending == 0, 30, "the quota outbox to drain")
        assert usage(redis_server.url, "stall") == {
            "requests_per_minute": 0, "tokens_per_minute": 0, "concurrent_requests": 0, "tokens_per_day": 0}
        # Served requests are charged what they used, to the token.
        r = httpx.post(gw.url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        # The lease is released and the use settled after the response went out: poll for it.
        served = r.json()["usage"]["total_tokens"]
        u = wait_for(lambda: (x := usage(redis_server.url, "stall"))["concurrent_requests"] == 0
                     and x["tokens_per_day"] == served and x, 30, "the served request to be settled")
        assert u["tokens_per_day"] == u["tokens_per_minute"] == served
    finally:
        gw.stop()


def test_killed_gateway_mid_stream_is_charged_what_it_served_once_its_lease_expires(redis_server, own_tmp):
    tenants = write_tenants(own_tmp / "ledger.yaml", [
        {"id": "ledger", "api_keys_sha256": [hash_key("k-ledger")], "quotas": {"tokens_per_day": 10_000_000}}])
    lease_ttl = 2.0
    doomed = GatewayProcess(["--redis-url", redis_server.url, "--tenants", tenants, "--lease-ttl", str(lease_ttl)],
                            own_tmp / "doomed.log")
    resv_key = "kvrelay:quota:{ledger}:resv"
    db = redis.Redis.from_url(redis_server.url)
    try:
        # A client that reads one chunk and then nothing, through a small receive buffer: the gateway
        # blocks on back-pressure mid-stream, holding its lease with part of the reservation used.
        body = json.dumps({"model": MODEL, "prompt": "Once", "max_tokens": 400, "ignore_eos": True,
                           "stream": True, "n": 4, "logprobs": 20}).encode()
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.connect(("127.0.0.1", doomed.port))
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-api-key: k-ledger\r\n"
                       b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        assert client.recv(1024).startswith(b"HTTP/1.1 200")

        def reported():  # "reserved|day|used": the renewals report the tokens used so far
            values = db.hvals(resv_key)
            return values and int(values[0].split(b"|")[2]) > 0 and values[0]

        wait_for(reported, 30, "a lease renewal reporting the tokens used")
        doomed.kill()
        client.close()
        reserved, _, used = (int(x) for x in db.hvals(resv_key)[0].split(b"|"))  # no renewal after the kill
        assert 0 < used < reserved
        assert usage(redis_server.url, "ledger")["tokens_per_day"] == reserved  # still held by the lease
        time.sleep(lease_ttl)
        # The next script that touches the tenant reaps the lease and refunds the unused part.
        u = wait_for(lambda: (x := usage(redis_server.url, "ledger"))["concurrent_requests"] == 0 and x,
                     lease_ttl + 10, "the lease to be reaped")
        assert u["tokens_per_day"] == used
        assert db.hlen(resv_key) == 0
    finally:
        db.close()
        doomed.stop()
