"""No charge without service: the quota ledger after a stalled Redis and after a killed gateway.

Each test owns its redis-server (on a free port) so it can freeze or restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import time

import httpx
import redis
from gateway_helpers import GatewayProcess, InProcessGateway, engine_children, write_tenants
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


def _reported_use(db: redis.Redis, resv_key: str) -> int | None:
    """The tokens used that the lease's last renewal reported ("reserved|day|used"); None once the
    lease is gone (the request completed)."""
    values = db.hvals(resv_key)
    return int(values[0].split(b"|")[2]) if values else None


def _stream_then_freeze_engine(gw: GatewayProcess, engine: int, db: redis.Redis, resv_key: str) -> socket.socket:
    """Start a long stream and SIGSTOP `serve`'s engine process once the first chunk is out, so the
    gateway holds its lease mid-request, renewing it with part of the reservation used. Returns the
    client's socket, to keep open: closing it is a disconnect, which ends the request.

    Back-pressure alone does not hold the stream: the kernel's send buffer (tcp_wmem, up to 4 MB)
    takes all of it, and stories260K writes it in about a second. The freeze can still come after
    the last token on a stalled machine: then the lease goes away, and we try again."""
    body = json.dumps({"model": MODEL, "prompt": "Once", "max_tokens": 400, "ignore_eos": True,
                       "stream": True, "n": 4, "logprobs": 20}).encode()
    for _ in range(5):
        client = socket.create_connection(("127.0.0.1", gw.port))
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-api-key: k-ledger\r\n"
                       b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        assert client.recv(1024).startswith(b"HTTP/1.1 200")  # sent with the first engine output
        os.kill(engine, signal.SIGSTOP)
        used = wait_for(lambda: (u := _reported_use(db, resv_key)) != 0 and ("gone" if u is None else u), 30,
                        "a lease renewal reporting the tokens used, or the request's end")
        if used != "gone":
            return client
        os.kill(engine, signal.SIGCONT)
        client.close()
    raise AssertionError("every stream finished before the engine could be frozen")


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
    (engine,) = engine_children(doomed.proc.pid)
    try:
        client = _stream_then_freeze_engine(doomed, engine, db, resv_key)
        doomed.kill()  # the API process first: with its engine gone it would end the request itself
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
        with contextlib.suppress(ProcessLookupError):
            os.kill(engine, signal.SIGKILL)
