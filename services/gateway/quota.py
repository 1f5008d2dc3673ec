"""Tenant quotas: requests/minute, tokens/minute, concurrent requests, tokens/day.

Admission reserves `prompt tokens + max_tokens` up front, so a tenant can never run past its
token quotas by having many long requests in flight; completion refunds what was reserved
but not generated. Windows:

- requests and tokens per minute: a sliding 60 s log (each admission is one entry scored by
  its time), which is exact: at most the limit within any 60 s span;
- tokens per day: one counter per UTC day;
- concurrent requests: leases with a TTL, renewed by the gateway that holds them, so the
  slots of a gateway that dies come back after at most one TTL.

Two stores with the same semantics: `RedisQuotaStore` (exact across any number of gateway
replicas: each decision is one Lua script run atomically, with time from Redis's clock) and
`MemoryQuotaStore` (one process). `QuotaManager` adds the lease renewer and the policy for
an unreachable Redis (fail closed: 503, or fail open: admit unaccounted).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from kvrelay.gateway.tenants import Quotas

log = logging.getLogger(__name__)

WINDOW_MS = 60_000
DAY_MS = 86_400_000
LIMITS = ("requests_per_minute", "tokens_per_minute", "concurrent_requests", "tokens_per_day")


@dataclass
class Admission:
    tenant_id: str
    request_id: str
    reserved_tokens: int
    day: int  # the UTC day (ms // DAY_MS) whose counter holds the reservation
    accounted: bool = True  # False when admitted fail-open without the store
    headers: dict[str, str] = field(default_factory=dict)


class QuotaExceeded(Exception):
    def __init__(self, limit: str, retry_after_s: float, headers: dict[str, str]):
        super().__init__(f"{limit} quota exceeded; retry after {retry_after_s:.1f} s")
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.headers = headers


class QuotaStoreUnavailable(Exception):
    """The quota store (Redis) could not be reached or answered with an error."""


@dataclass
class Decision:
    """The raw outcome both stores compute; headers are derived from it in one place."""

    admitted: bool
    limit: str | None  # which limit rejected
    retry_after_ms: int
    requests_in_window: int
    tokens_in_window: int
    now_ms: int


def _limit(value: int | None) -> int:
    return -1 if value is None else int(value)


def _rate_headers(q: Quotas, d: Decision, tokens: int) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers (remaining counts include this request when admitted)."""
    h: dict[str, str] = {}
    if q.requests_per_minute is not None:
        used = d.requests_in_window + (1 if d.admitted else 0)
        h["x-ratelimit-limit-requests"] = str(q.requests_per_minute)
        h["x-ratelimit-remaining-requests"] = str(max(0, q.requests_per_minute - used))
    if q.tokens_per_minute is not None:
        used = d.tokens_in_window + (tokens if d.admitted else 0)
        h["x-ratelimit-limit-tokens"] = str(q.tokens_per_minute)
        h["x-ratelimit-remaining-tokens"] = str(max(0, q.tokens_per_minute - used))
    if not d.admitted:
        h["Retry-After"] = str(max(1, math.ceil(d.retry_after_ms / 1000)))
        h[f"x-ratelimit-reset-{'tokens' if 'token' in (d.limit or '') else 'requests'}"] = (
            f"{d.retry_after_ms / 1000:.3f}s")
    return h


class QuotaStore(Protocol):
    async def admit(self, tenant_id: str, quotas: Quotas, request_id: str, tokens: int,
                    lease_ttl_ms: int) -> Decision: ...
    async def complete(self, tenant_id: str, request_id: str, refund: int, day: int) -> None: ...
    async def renew(self, tenant_id: str, request_ids: list[str], lease_ttl_ms: int) -> None: ...
    async def usage(self, tenant_id: str) -> dict[str, int]: ...
    async def close(self) -> None: ...


# --------------------------------------------------------------------------- in-memory store


@dataclass
class _TenantState:
    requests: OrderedDict[str, int] = field(default_factory=OrderedDict)  # request id -> admitted at ms
    tokens: OrderedDict[str, tuple[int, int]] = field(default_factory=OrderedDict)  # id -> (at ms, tokens)
    token_sum: int = 0
    leases: dict[str, int] = field(default_factory=dict)  # request id -> expires at ms
    days: dict[int, int] = field(default_factory=dict)  # UTC day -> tokens


class MemoryQuotaStore:
    """The single-process store. Same windows and answers as the Redis scripts."""

    def __init__(self, clock=time.time):
        self._clock = clock
        self._state: dict[str, _TenantState] = {}

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def _expire(self, s: _TenantState, now: int) -> None:
        while s.requests and next(iter(s.requests.values())) <= now - WINDOW_MS:
            s.requests.popitem(last=False)
        while s.tokens and next(iter(s.tokens.values()))[0] <= now - WINDOW_MS:
            _, (_, n) = s.tokens.popitem(last=False)
            s.token_sum -= n
        for rid in [r for r, exp in s.leases.items() if exp <= now]:
            del s.leases[rid]
        for day in [d for d in s.days if d < now // DAY_MS - 1]:
            del s.days[day]

    async def admit(self, tenant_id, quotas, request_id, tokens, lease_ttl_ms) -> Decision:
        now = self._now_ms()
        s = self._state.setdefault(tenant_id, _TenantState())
        self._expire(s, now)
        day = now // DAY_MS
        rpm, tpm = _limit(quotas.requests_per_minute), _limit(quotas.tokens_per_minute)
        conc, tpd = _limit(quotas.concurrent_requests), _limit(quotas.tokens_per_day)
        nreq, tsum = len(s.requests), s.token_sum

        def reject(limit: str, retry_ms: int) -> Decision:
            return Decision(False, limit, max(0, retry_ms), nreq, tsum, now)

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
        s.days[day] = s.days.get(day, 0) + tokens
        return Decision(True, None, 0, nreq, tsum, now)

    async def complete(self, tenant_id, request_id, refund, day) -> None:
        s = self._state.get(tenant_id)
        if s is None:
            return
        s.leases.pop(request_id, None)
        if refund > 0:
            if request_id in s.tokens:
                at, n = s.tokens[request_id]
                r = min(refund, n)
                s.tokens[request_id] = (at, n - r)
                s.token_sum -= r
            if day in s.days:
                s.days[day] = max(0, s.days[day] - refund)

    async def renew(self, tenant_id, request_ids, lease_ttl_ms) -> None:
        s = self._state.get(tenant_id)
        if s is None:
            return
        expires = self._now_ms() + lease_ttl_ms
        for rid in request_ids:
            if rid in s.leases:
                s.leases[rid] = expires

    async def usage(self, tenant_id) -> dict[str, int]:
        now = self._now_ms()
        s = self._state.setdefault(tenant_id, _TenantState())
        self._expire(s, now)
        return {"requests_per_minute": len(s.requests), "tokens_per_minute": s.token_sum,
                "concurrent_requests": len(s.leases), "tokens_per_day": s.days.get(now // DAY_MS, 0)}

    async def close(self) -> None:
        pass


# --------------------------------------------------------------------------- Redis store

# KEYS: 1 request log (zset id->ms), 2 token log (zset id->ms), 3 token amounts (hash id->n),
#       4 token sum (string), 5 leases (zset id->expiry ms), 6 day counter prefix
_EXPIRE_LUA = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function expire(now, window)
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - window)
  while true do
    local old = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - window, 'LIMIT', 0, 500)
    if #old == 0 then break end
    local vals = redis.call('HMGET', KEYS[3], unpack(old))
    local s = 0
    for _, v in ipairs(vals) do if v then s = s + tonumber(v) end end
    redis.call('DECRBY', KEYS[4], s)
    redis.call('HDEL', KEYS[3], unpack(old))
    redis.call('ZREM', KEYS[2], unpack(old))
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
end
"""

_ADMIT_LUA = _EXPIRE_LUA + """
local rid, tokens = ARGV[1], tonumber(ARGV[2])
local rpm, tpm, conc, tpd = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local ttl, window, daylen = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local now = now_ms()
expire(now, window)
local day = math.floor(now / daylen)
local daykey = KEYS[6] .. ':' .. day
local nreq = redis.call('ZCARD', KEYS[1])
local tsum = tonumber(redis.call('GET', KEYS[4]) or '0')
local nconc = redis.call('ZCARD', KEYS[5])
local dsum = tonumber(redis.call('GET', daykey) or '0')
if rpm >= 0 and nreq + 1 > rpm then
  local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  local at = now
  if #first > 0 then at = tonumber(first[2]) end
  return {0, 'requests_per_minute', at + window - now, nreq, tsum, now}
end
if tpm >= 0 and tsum + tokens > tpm then
  local retry, freed, start = window, 0, 0
  while retry == window do
    local batch = redis.call('ZRANGE', KEYS[2], start, start + 499, 'WITHSCORES')
    if #batch == 0 then break end
    for i = 1, #batch, 2 do
      freed = freed + tonumber(redis.call('HGET', KEYS[3], batch[i]) or '0')
      if tsum - freed + tokens <= tpm then retry = tonumber(batch[i + 1]) + window - now; break end
    end
    start = start + 500
  end
  return {0, 'tokens_per_minute', retry, nreq, tsum, now}
end
if conc >= 0 and nconc + 1 > conc then
  return {0, 'concurrent_requests', 1000, nreq, tsum, now}
end
if tpd >= 0 and dsum + tokens > tpd then
  return {0, 'tokens_per_day', (day + 1) * daylen - now, nreq, tsum, now}
end
redis.call('ZADD', KEYS[1], now, rid)
redis.call('ZADD', KEYS[2], now, rid)
redis.call('HSET', KEYS[3], rid, tokens)
redis.call('INCRBY', KEYS[4], tokens)
redis.call('ZADD', KEYS[5], now + ttl, rid)
redis.call('INCRBY', daykey, tokens)
for i = 1, 4 do redis.call('PEXPIRE', KEYS[i], window + 1000) end
redis.call('PEXPIRE', KEYS[5], ttl + 1000)
redis.call('PEXPIRE', daykey, 2 * daylen)
return {1, '', 0, nreq, tsum, now}
"""

_COMPLETE_LUA = """
local rid, refund, day = ARGV[1], tonumber(ARGV[2]), ARGV[3]
redis.call('ZREM', KEYS[5], rid)
if refund > 0 then
  local v = redis.call('HGET', KEYS[3], rid)
  if v then
    local r = math.min(refund, tonumber(v))
    redis.call('HINCRBY', KEYS[3], rid, -r)
    redis.call('DECRBY', KEYS[4], r)
  end
  local daykey = KEYS[6] .. ':' .. day
  local d = tonumber(redis.call('GET', daykey) or '-1')
  if d >= 0 then redis.call('DECRBY', daykey, math.min(refund, d)) end
end
return 1
"""

_RENEW_LUA = """
local t = redis.call('TIME')
local expires = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', expires, ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) + 1000)
return 1
"""

_USAGE_LUA = _EXPIRE_LUA + """
local now = now_ms()
expire(now, tonumber(ARGV[1]))
local day = math.floor(now / tonumber(ARGV[2]))
return {redis.call('ZCARD', KEYS[1]), tonumber(redis.call('GET', KEYS[4]) or '0'),
        redis.call('ZCARD', KEYS[5]), tonumber(redis.call('GET', KEYS[6] .. ':' .. day) or '0')}
"""


class RedisQuotaStore:
    """Exact quotas shared by every gateway replica pointing at the same Redis."""

    def __init__(self, url: str, prefix: str = "kvrelay:quota", timeout_s: float = 0.5):
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        # One quick retry covers a connection Redis closed while idle; no backoff so a dead
        # Redis costs a request at most ~2 timeouts before the failure policy applies.
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 1), health_check_interval=0)
        self.prefix = prefix
        self._admit = self._redis.register_script(_ADMIT_LUA)
        self._complete = self._redis.register_script(_COMPLETE_LUA)
        self._renew = self._redis.register_script(_RENEW_LUA)
        self._usage = self._redis.register_script(_USAGE_LUA)

    def keys(self, tenant_id: str) -> list[str]:
        # The {tenant} hash tag keeps one tenant's keys in one Redis Cluster slot.
        base = f"{self.prefix}:{{{tenant_id}}}"
        return [f"{base}:req", f"{base}:tok", f"{base}:tokn", f"{base}:toksum", f"{base}:lease", f"{base}:day"]

    async def _run(self, script, keys, args):
        from redis.exceptions import RedisError

        try:
            return await script(keys=keys, args=args)
        except (RedisError, OSError) as e:
            raise QuotaStoreUnavailable(f"quota store (Redis) unavailable: {type(e).__name__}: {e}") from e

    async def admit(self, tenant_id, quotas, request_id, tokens, lease_ttl_ms) -> Decision:
        args = [request_id, tokens, _limit(quotas.requests_per_minute), _limit(quotas.tokens_per_minute),
                _limit(quotas.concurrent_requests), _limit(quotas.tokens_per_day), lease_ttl_ms, WINDOW_MS, DAY_MS]
        ok, limit, retry, nreq, tsum, now = await self._run(self._admit, self.keys(tenant_id), args)
        limit = limit.decode() if isinstance(limit, bytes) else limit
        return Decision(bool(ok), limit or None, int(retry), int(nreq), int(tsum), int(now))

    async def complete(self, tenant_id, request_id, refund, day) -> None:
        await self._run(self._complete, self.keys(tenant_id), [request_id, max(0, refund), day])

    async def renew(self, tenant_id, request_ids, lease_ttl_ms) -> None:
        if request_ids:
            await self._run(self._renew, [self.keys(tenant_id)[4]], [lease_ttl_ms, *request_ids])

    async def usage(self, tenant_id) -> dict[str, int]:
        values = await self._run(self._usage, self.keys(tenant_id), [WINDOW_MS, DAY_MS])
        return dict(zip(LIMITS, (int(v) for v in values)))

    async def close(self) -> None:
        await self._redis.aclose()


# --------------------------------------------------------------------------- manager


class QuotaManager:
    """Admission and reconciliation for the request path, plus lease renewal.

    `fail_open=False` (the default) turns an unreachable store into 503s; `fail_open=True`
    admits such requests unaccounted (they are not refunded or counted later). Either way
    the gateway keeps serving and uses the store again as soon as it answers.
    """

    def __init__(self, store: QuotaStore, lease_ttl_s: float = 30.0, fail_open: bool = False):
        self.store = store
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.fail_open = fail_open
        self._live: dict[str, Admission] = {}
        self._renewer: asyncio.Task | None = None

    async def admit(self, tenant_id: str, quotas: Quotas, request_id: str, tokens: int) -> Admission:
        """Reserve one request and `tokens`; raises QuotaExceeded or QuotaStoreUnavailable."""
        if all(getattr(quotas, name) is None for name in LIMITS):
            return Admission(tenant_id, request_id, tokens, 0, accounted=False)
        try:
            d = await self.store.admit(tenant_id, quotas, request_id, tokens, self.lease_ttl_ms)
        except QuotaStoreUnavailable as e:
            if not self.fail_open:
                raise
            log.warning("admitting %s unaccounted (fail-open): %s", request_id, e)
            return Admission(tenant_id, request_id, tokens, 0, accounted=False)
        headers = _rate_headers(quotas, d, tokens)
        if not d.admitted:
            raise QuotaExceeded(d.limit or "quota", d.retry_after_ms / 1000, headers)
        adm = Admission(tenant_id, request_id, tokens, d.now_ms // DAY_MS, True, headers)
        self._live[request_id] = adm
        self._ensure_renewer()
        return adm

    async def complete(self, adm: Admission, used_tokens: int) -> None:
        """Release the lease and refund reserved tokens that were not used."""
        if not adm.accounted:
            return
        self._live.pop(adm.request_id, None)
        try:
            await self.store.complete(adm.tenant_id, adm.request_id, adm.reserved_tokens - used_tokens, adm.day)
        except QuotaStoreUnavailable as e:
            # The lease expires by itself; the unrefunded tokens leave the window in 60 s.
            log.warning("could not reconcile %s: %s", adm.request_id, e)

    def _ensure_renewer(self) -> None:
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.get_running_loop().create_task(self._renew_loop())

    async def _renew_loop(self) -> None:
        while self._live:
            await asyncio.sleep(self.lease_ttl_ms / 3000)
            by_tenant: dict[str, list[str]] = {}
            for adm in list(self._live.values()):
                by_tenant.setdefault(adm.tenant_id, []).append(adm.request_id)
            for tenant_id, ids in by_tenant.items():
                try:
                    await self.store.renew(tenant_id, ids, self.lease_ttl_ms)
                except QuotaStoreUnavailable as e:
                    log.warning("lease renewal failed for tenant %s: %s", tenant_id, e)

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
        await self.store.close()
