"""The single-process quota store: the same windows, leases and settlement as the Redis scripts.

Also the fail-open fallback of a Redis-backed gateway: while Redis is unreachable the
gateway still enforces each tenant's quotas locally (per replica), and charges what it
served to Redis when Redis answers again.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvrelay.gateway.quota_store import DAY_MS, DEADLINE_PASSED, WINDOW_MS, Decision, limit_arg


@dataclass
class _Reservation:
    reserved: int  # tokens currently charged for the request
    used: int  # tokens used as last reported (what a reap settles at)
    day: int


@dataclass
class _TenantState:
    requests: OrderedDict[str, int] = field(default_factory=OrderedDict)  # request id -> admitted at ms
    tokens: OrderedDict[str, tuple[int, int]] = field(default_factory=OrderedDict)  # id -> (at ms, tokens)
    token_sum: int = 0
    leases: dict[str, int] = field(default_factory=dict)  # request id -> expires at ms
    reservations: dict[str, _Reservation] = field(default_factory=dict)
    days: dict[int, int] = field(default_factory=dict)  # UTC day -> tokens


class MemoryQuotaStore:
    def __init__(self, clock=time.time):
        self._clock = clock
        self._state: dict[str, _TenantState] = {}

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _settle(self, s: _TenantState, rid: str, used: int) -> None:
        """Charge the request `used` tokens in all: refund (or add) the difference to its reservation."""
        r = s.reservations.get(rid)
        if r is None:
            return
        delta = r.reserved - used  # > 0: refund
        if rid in s.tokens:
            at, n = s.tokens[rid]
            d = min(delta, n)
            s.tokens[rid] = (at, n - d)
            s.token_sum -= d
        if r.day in s.days:
            s.days[r.day] = max(0, s.days[r.day] - delta)
        r.reserved = r.used = used

    def _expire(self, s: _TenantState, now: int) -> None:
        while s.requests and next(iter(s.requests.values())) <= now - WINDOW_MS:
            s.requests.popitem(last=False)
        while s.tokens and next(iter(s.tokens.values()))[0] <= now - WINDOW_MS:
            _, (_, n) = s.tokens.popitem(last=False)
            s.token_sum -= n
        for rid in [r for r, exp in s.leases.items() if exp <= now]:
            del s.leases[rid]
            if rid in s.reservations:  # a lease nobody reconciled: settle at its last reported use
                self._settle(s, rid, s.reservations[rid].used)
        for day in [d for d in s.days if d < now // DAY_MS - 1]:
            del s.days[day]

    async def admit(self, tenant_id, quotas, request_id, tokens, lease_ttl_ms, deadline_s=None) -> Decision:
        now = self._now_ms()
        s = self._state.setdefault(tenant_id, _TenantState())
        self._expire(s, now)
        day = now // DAY_MS
        rpm, tpm = limit_arg(quotas.requests_per_minute), limit_arg(quotas.tokens_per_minute)
        conc, tpd = limit_arg(quotas.concurrent_requests), limit_arg(quotas.tokens_per_day)
        nreq, tsum = len(s.requests), s.token_sum

        def reject(limit: str, retry_ms: int) -> Decision:
            return Decision(False, limit, max(0, retry_ms), nreq, tsum, now)

        if deadline_s is not None and now > deadline_s * 1000:
            return reject(DEADLINE_PASSED, 0)
        if request_id in s.reservations:  # the same admission seen twice: already holds its reservation
            return Decision(True, None, 0, nreq, tsum, now)
        if rpm >= 0 and nreq + 1 > rpm:
            oldest = next(iter(s.requests.values()), now)
            return reject("requests_per_minute", oldest + WINDOW_MS - now)
        if tpm >= 0 and tsum + tokens > tpm:
            freed, retry = 0, WINDOW_MS
            for at, n in s.tokens.values():
                freed += n
                if tsum - freed + tokens <= tpm:
                    retry = at + WINDOW_MS - now
                    break
            return reject("tokens_per_minute", retry)
        if conc >= 0 and len(s.leases) + 1 > conc:
            return reject("concurrent_requests", 1000)
        if tpd >= 0 and s.days.get(day, 0) + tokens > tpd:
            return reject("tokens_per_day", (day + 1) * DAY_MS - now)
        s.requests[request_id] = now
        s.tokens[request_id] = (now, tokens)
        s.token_sum += tokens
        s.leases[request_id] = now + lease_ttl_ms
        s.reservations[request_id] = _Reservation(tokens, 0, day)
        s.days[day] = s.days.get(day, 0) + tokens
        return Decision(True, None, 0, nreq, tsum, now)

    async def complete(self, tenant_id, request_id, used) -> None:
        s = self._state.get(tenant_id)
        if s is None:
            return
        s.leases.pop(request_id, None)
        self._settle(s, request_id, used)
        s.reservations.pop(request_id, None)

    async def renew(self, tenant_id, used_by_request, lease_ttl_ms) -> None:
        s = self._state.get(tenant_id)
        if s is None:
            return
        expires = self._now_ms() + lease_ttl_ms
        for rid, used in used_by_request.items():
            if rid in s.leases:
                s.leases[rid] = expires
                s.reservations[rid].used = used

    async def void(self, tenant_id, request_id) -> None:
        s = self._state.get(tenant_id)
        if s is None or request_id not in s.reservations:
            return
        s.leases.pop(request_id, None)
        s.requests.pop(request_id, None)
        self._settle(s, request_id, 0)
        s.reservations.pop(request_id, None)

    async def charge(self, tenant_id, request_id, used) -> None:
        now = self._now_ms()
        s = self._state.setdefault(tenant_id, _TenantState())
        s.requests.setdefault(request_id, now)
        if request_id not in s.tokens:
            s.tokens[request_id] = (now, used)
            s.token_sum += used
        s.days[now // DAY_MS] = s.days.get(now // DAY_MS, 0) + used

    async def requests_in_window(self, tenant_id, deadline_s=None) -> tuple[int, int, int]:
        now = self._now_ms()
        s = self._state.setdefault(tenant_id, _TenantState())
        self._expire(s, now)
        return len(s.requests), next(iter(s.requests.values()), now), now

    async def usage(self, tenant_id) -> dict[str, int]:
        now = self._now_ms()
        s = self._state.setdefault(tenant_id, _TenantState())
        self._expire(s, now)
        return {"requests_per_minute": len(s.requests), "tokens_per_minute": s.token_sum,
                "concurrent_requests": len(s.leases), "tokens_per_day": s.days.get(now // DAY_MS, 0)}

    async def close(self) -> None:
        pass
