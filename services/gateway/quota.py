"""Tenant quotas on the request path: requests/minute, tokens/minute, concurrent requests, tokens/day.

Admission reserves `prompt tokens + max_tokens` up front, so a tenant can never run past its
token quotas by having many long requests in flight; completion settles the reservation
at the tokens really used. Windows:

- requests and tokens per minute: a sliding 60 s log (each admission is one entry scored by
  its time), which is exact: at most the limit within any 60 s span;
- tokens per day: one counter per UTC day;
- concurrent requests: leases with a TTL, renewed (with the tokens used so far) by the
  gateway that holds them; a dead gateway's leases are settled and freed after one TTL.

Stores: `RedisQuotaStore` (quota_redis.py, exact across replicas) and `MemoryQuotaStore`
(quota_memory.py, one process). `QuotaManager` adds the lease renewer, the policy for an
unreachable Redis (fail closed: 503; fail open: enforce the quotas locally, per replica)
and an outbox of store updates replayed once Redis answers again, so that the ledger ends
equal to what was served: reconciles that failed, admissions whose answer was lost (voided),
and requests served fail-open (charged).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from kvrelay.gateway.quota_memory import MemoryQuotaStore
from kvrelay.gateway.quota_redis import RedisQuotaStore
from kvrelay.gateway.quota_store import (
    DAY_MS,
    DEADLINE_PASSED,
    LIMITS,
    WINDOW_MS,
    Decision,
    QuotaExceeded,
    QuotaStore,
    QuotaStoreBusy,
    QuotaStoreUnavailable,
    rate_headers,
)
from kvrelay.gateway.tenants import Quotas

__all__ = ["Admission", "MemoryQuotaStore", "QuotaExceeded", "QuotaManager", "QuotaStoreBusy",
           "QuotaStoreUnavailable", "RedisQuotaStore"]

log = logging.getLogger(__name__)
MAX_OUTBOX = 100_000  # store updates kept while Redis is away; older ones are dropped (and logged)


@dataclass
class Admission:
    tenant_id: str
    request_id: str
    reserved_tokens: int
    day: int  # the UTC day (ms // DAY_MS) whose counter holds the reservation
    accounted: bool = True  # False: not in the shared store (unlimited tenant, or admitted fail-open)
    headers: dict[str, str] = field(default_factory=dict)
    fallback: bool = False  # admitted by the local store while the shared one was unreachable
    used: int = 0  # tokens used so far (prompt + generated), reported with each lease renewal


class QuotaManager:
    """Admission and reconciliation for the request path, plus lease renewal and the outbox.

    `wait_s` bounds how long an admission may wait for a free store connection (back-pressure);
    a store that errs or stays silent for its own timeout applies the failure policy instead.
    """

    def __init__(self, store: QuotaStore, lease_ttl_s: float = 30.0, fail_open: bool = False,
                 wait_s: float = 10.0, retry_interval_s: float = 0.5):
        self.store = store
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.fail_open = fail_open
        self.wait_s = wait_s
        self.retry_interval_s = retry_interval_s
        self.fallback = MemoryQuotaStore()  # fail-open: quotas still hold per replica
        self._live: dict[str, Admission] = {}
        self._outbox: list[tuple[str, tuple]] = []  # (store method, args), replayed in order
        self._renewer: asyncio.Task | None = None
        self._replayer: asyncio.Task | None = None

    async def admit(self, tenant_id: str, quotas: Quotas, request_id: str, tokens: int) -> Admission:
        """Reserve one request and `tokens`; raises QuotaExceeded, QuotaStoreBusy or QuotaStoreUnavailable."""
        if all(getattr(quotas, name) is None for name in LIMITS):
            return Admission(tenant_id, request_id, tokens, 0, accounted=False)
        try:
            d = await self.store.admit(tenant_id, quotas, request_id, tokens, self.lease_ttl_ms,
                                       time.time() + self.wait_s)
            if d.limit == DEADLINE_PASSED:  # Redis ran it too late (it took nothing): a timeout
                raise QuotaStoreUnavailable("the quota store answered after the admission's deadline")
        except QuotaStoreUnavailable as e:
            # The script may have run (its answer was lost): undo it once Redis answers. A script
            # still queued in Redis finds its deadline passed and takes nothing.
            self._defer("void", tenant_id, request_id)
            if not self.fail_open:
                raise
            log.warning("admitting %s on local quotas (fail-open): %s", request_id, e)
            d = await self.fallback.admit(tenant_id, quotas, request_id, tokens, self.lease_ttl_ms)
            if not d.admitted:
                raise QuotaExceeded(d.limit or "quota", d.retry_after_ms / 1000, rate_headers(quotas, d, tokens))
            return Admission(tenant_id, request_id, tokens, d.now_ms // DAY_MS, False,
                             rate_headers(quotas, d, tokens), fallback=True)
        headers = rate_headers(quotas, d, tokens)
        if not d.admitted:
            raise QuotaExceeded(d.limit or "quota", d.retry_after_ms / 1000, headers)
        adm = Admission(tenant_id, request_id, tokens, d.now_ms // DAY_MS, True, headers)
        self._live[request_id] = adm
        self._ensure_task("_renewer", self._renew_loop)
        return adm

    async def requests_exhausted(self, tenant_id: str, quotas: Quotas) -> dict[str, str] | None:
        """The 429's headers when the tenant has no request left this minute, else None (a read only:
        admission decides). Store failures answer None and are left to admission's policy."""
        if quotas.requests_per_minute is None:
            return None
        try:
            n, oldest, now = await self.store.requests_in_window(tenant_id, time.time() + self.wait_s)
        except (QuotaStoreUnavailable, QuotaStoreBusy):
            return None
        if n < quotas.requests_per_minute:
            return None
        d = Decision(False, "requests_per_minute", max(0, oldest + WINDOW_MS - now), n, 0, now)
        return rate_headers(Quotas(requests_per_minute=quotas.requests_per_minute), d, 0)

    async def complete(self, adm: Admission, used_tokens: int) -> None:
        """Release the lease and settle the reservation at the tokens used."""
        if adm.fallback:
            await self.fallback.complete(adm.tenant_id, adm.request_id, used_tokens)
            await self._try("charge", adm.tenant_id, adm.request_id, used_tokens)
            return
        if not adm.accounted:
            return
        self._live.pop(adm.request_id, None)
        await self._try("complete", adm.tenant_id, adm.request_id, used_tokens)

    async def _try(self, method: str, *args) -> None:
        try:
            await getattr(self.store, method)(*args)
        except (QuotaStoreUnavailable, QuotaStoreBusy) as e:
            log.warning("quota store: %s of %s deferred until it answers: %s", method, args[1], e)
            self._defer(method, *args)

    def _defer(self, method: str, *args) -> None:
        if len(self._outbox) >= MAX_OUTBOX:
            log.error("quota outbox full: dropping %s of %s", *self._outbox.pop(0))
        self._outbox.append((method, args))
        self._ensure_task("_replayer", self._replay_loop)

    def _ensure_task(self, name: str, loop) -> None:
        task = getattr(self, name)
        if task is None or task.done():
            setattr(self, name, asyncio.get_running_loop().create_task(loop()))

    async def _replay_loop(self) -> None:
        while self._outbox:
            await asyncio.sleep(self.retry_interval_s)
            while self._outbox:
                method, args = self._outbox[0]
                try:
                    await getattr(self.store, method)(*args)
                except (QuotaStoreUnavailable, QuotaStoreBusy):
                    break  # still away: keep the order, try again later
                self._outbox.pop(0)

    async def _renew_loop(self) -> None:
        while self._live:
            await asyncio.sleep(self.lease_ttl_ms / 3000)
            by_tenant: dict[str, dict[str, int]] = {}
            for adm in list(self._live.values()):
                by_tenant.setdefault(adm.tenant_id, {})[adm.request_id] = adm.used
            for tenant_id, used in by_tenant.items():
                try:
                    await self.store.renew(tenant_id, used, self.lease_ttl_ms)
                except (QuotaStoreUnavailable, QuotaStoreBusy) as e:
                    log.warning("lease renewal failed for tenant %s: %s", tenant_id, e)

    @property
    def pending(self) -> int:
        """Store updates waiting for the store to answer."""
        return len(self._outbox)

    async def close(self) -> None:
        for task in (self._renewer, self._replayer):
            if task is not None:
                task.cancel()
        await self.store.close()
