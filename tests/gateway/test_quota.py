"""Quota semantics, one suite run against both stores: in-memory and a real Redis."""

from __future__ import annotations

import asyncio

import pytest
from kvrelay.gateway.quota import (
    MemoryQuotaStore,
    QuotaExceeded,
    QuotaManager,
    QuotaStoreUnavailable,
    RedisQuotaStore,
)
from kvrelay.gateway.tenants import Quotas


@pytest.fixture(params=["memory", "redis"])
async def store(request):
    if request.param == "memory":
        s = MemoryQuotaStore()
    else:
        server = request.getfixturevalue("redis_server")
        s = RedisQuotaStore(server.url, prefix=f"t{id(request)}")
    yield s
    await s.close()


async def test_requests_per_minute_is_exact_under_concurrency(store):
    mgr = QuotaManager(store)
    q = Quotas(requests_per_minute=7)
    results = await asyncio.gather(*(mgr.admit("a", q, f"r{i}", 1) for i in range(30)), return_exceptions=True)
    admitted = [r for r in results if not isinstance(r, Exception)]
    rejected = [r for r in results if isinstance(r, QuotaExceeded)]
    assert len(admitted) == 7 and len(rejected) == 23
    assert rejected[0].limit == "requests_per_minute"
    assert 1 <= int(rejected[0].headers["Retry-After"]) <= 60
    assert rejected[0].headers["x-ratelimit-remaining-requests"] == "0"
    # another tenant is unaffected
    await mgr.admit("b", q, "other", 1)
    await mgr.close()


async def test_tokens_reserved_then_refunded(store):
    mgr = QuotaManager(store)
    q = Quotas(tokens_per_minute=100, tokens_per_day=1000)
    a = await mgr.admit("t", q, "r1", 60)
    with pytest.raises(QuotaExceeded) as exc:
        await mgr.admit("t", q, "r2", 50)
    assert exc.value.limit == "tokens_per_minute"
    assert exc.value.headers["x-ratelimit-remaining-tokens"] == "40"
    await mgr.complete(a, used_tokens=25)  # 35 refunded
    assert (await store.usage("t"))["tokens_per_minute"] == 25
    assert (await store.usage("t"))["tokens_per_day"] == 25
    await mgr.admit("t", q, "r2", 50)
    assert (await store.usage("t"))["tokens_per_minute"] == 75
    await mgr.close()


async def test_tokens_per_day(store):
    mgr = QuotaManager(store)
    q = Quotas(tokens_per_day=10)
    await mgr.admit("d", q, "r1", 10)
    with pytest.raises(QuotaExceeded) as exc:
        await mgr.admit("d", q, "r2", 1)
    assert exc.value.limit == "tokens_per_day"
    assert exc.value.retry_after_s <= 86400
    await mgr.close()


async def test_concurrency_leases_release_and_expire(store):
    mgr = QuotaManager(store, lease_ttl_s=0.6)
    q = Quotas(concurrent_requests=2)
    a = await mgr.admit("c", q, "r1", 1)
    await mgr.admit("c", q, "r2", 1)
    with pytest.raises(QuotaExceeded) as exc:
        await mgr.admit("c", q, "r3", 1)
    assert exc.value.limit == "concurrent_requests"
    await mgr.complete(a, 1)
    await mgr.admit("c", q, "r3", 1)
    # Live leases are renewed by the manager: still held after several TTLs.
    await asyncio.sleep(1.5)
    assert (await store.usage("c"))["concurrent_requests"] == 2
    # A manager that stops renewing (its gateway died) loses them after one TTL.
    mgr._renewer.cancel()
    await asyncio.sleep(0.9)
    assert (await store.usage("c"))["concurrent_requests"] == 0
    await mgr.admit("c", q, "r4", 1)


async def test_unlimited_tenant_skips_the_store():
    mgr = QuotaManager(RedisQuotaStore("redis://127.0.0.1:1/0"))  # nothing listens on port 1
    adm = await mgr.admit("free", Quotas(), "r1", 10**9)
    assert not adm.accounted
    await mgr.close()


async def test_unreachable_redis_fail_closed_and_open():
    q = Quotas(requests_per_minute=5)
    closed = QuotaManager(RedisQuotaStore("redis://127.0.0.1:1/0", timeout_s=0.2))
    with pytest.raises(QuotaStoreUnavailable):
        await closed.admit("t", q, "r1", 1)
    opened = QuotaManager(RedisQuotaStore("redis://127.0.0.1:1/0", timeout_s=0.2), fail_open=True)
    adm = await opened.admit("t", q, "r1", 1)
    assert not adm.accounted
    await opened.complete(adm, 1)
    await closed.close()
    await opened.close()


async def test_expired_lease_settles_at_the_last_reported_use(store):
    mgr = QuotaManager(store, lease_ttl_s=0.6)
    q = Quotas(tokens_per_day=1000, tokens_per_minute=1000)
    adm = await mgr.admit("s", q, "r1", 100)
    adm.used = 30  # what the response has served so far; the next renewal reports it
    await asyncio.sleep(0.5)
    mgr._renewer.cancel()  # the gateway dies: no reconcile ever comes
    await asyncio.sleep(0.9)
    assert await store.usage("s") == {"requests_per_minute": 1, "tokens_per_minute": 30,
                                      "concurrent_requests": 0, "tokens_per_day": 30}
    await mgr.complete(adm, 30)  # a late reconcile of a reaped lease changes nothing
    assert (await store.usage("s"))["tokens_per_day"] == 30


async def test_void_undoes_an_admission_and_a_late_one_takes_nothing(store):
    q = Quotas(concurrent_requests=1, tokens_per_day=1000)
    await store.admit("v", q, "r1", 50, 60_000)
    await store.void("v", "r1")
    await store.void("v", "r1")  # replayed: still once
    assert await store.usage("v") == {"requests_per_minute": 0, "tokens_per_minute": 0,
                                      "concurrent_requests": 0, "tokens_per_day": 0}
    import time

    d = await store.admit("v", q, "r2", 50, 60_000, deadline_s=time.time() - 5)
    assert not d.admitted and d.limit == "deadline_passed"
    assert (await store.usage("v"))["tokens_per_day"] == 0


async def test_fail_open_enforces_quotas_locally_and_charges_redis_when_it_returns(redis_server):
    redis_server.stop()
    store = RedisQuotaStore(redis_server.url, timeout_s=0.2)
    mgr = QuotaManager(store, fail_open=True, retry_interval_s=0.1)
    q = Quotas(requests_per_minute=2, tokens_per_day=1000)
    a = await mgr.admit("o", q, "r1", 40)
    b = await mgr.admit("o", q, "r2", 40)
    assert a.fallback and b.fallback
    with pytest.raises(QuotaExceeded):  # the open policy still counts: 2 per minute on this replica
        await mgr.admit("o", q, "r3", 40)
    await mgr.complete(a, 25)
    await mgr.complete(b, 30)
    redis_server.start()
    for _ in range(100):
        if mgr.pending == 0:
            break
        await asyncio.sleep(0.1)
    assert mgr.pending == 0
    assert await store.usage("o") == {"requests_per_minute": 2, "tokens_per_minute": 55,
                                      "concurrent_requests": 0, "tokens_per_day": 55}
    await mgr.close()
