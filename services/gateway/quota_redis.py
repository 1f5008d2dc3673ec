"""The Redis quota store: exact across any number of gateway replicas sharing one Redis.

Each decision is one Lua script run atomically with time from Redis's own clock.

Connections are bounded and queued: at most `max_connections` commands are in flight per
gateway (a semaphore in front of a `BlockingConnectionPool` of the same size), and a
request waits for a free connection until its deadline. Running out of connections is
back-pressure (`QuotaStoreBusy`), never "Redis unavailable": only a Redis error or a
command that outlives its time budget is (`QuotaStoreUnavailable`).

No charge without service: an admission carries an absolute deadline, the moment the
gateway stops waiting for its answer. A script that Redis runs after it (Redis was
stalled, the command sat in a socket buffer) takes nothing. Every lease records its
reservation (`reserved|day|used`); a lease that expires unreconciled is settled at the
tokens its gateway last reported, and the rest is refunded.
"""

from __future__ import annotations

import asyncio
import math
import time

from kvrelay.gateway.quota_store import (
    DAY_MS,
    DEADLINE_PASSED,
    LIMITS,
    WINDOW_MS,
    Decision,
    QuotaStoreBusy,
    QuotaStoreUnavailable,
    limit_arg,
)

# KEYS: 1 request log (zset id->ms), 2 token log (zset id->ms), 3 token amounts (hash id->n),
#       4 token sum (string), 5 leases (zset id->expiry ms), 6 day counter prefix,
#       7 reservations (hash id->"reserved|day|used")
_COMMON_LUA = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function settle(rid, used)
  local v = redis.call('HGET', KEYS[7], rid)
  if not v then return end
  local reserved, day = string.match(v, '^(%d+)|(%d+)|')
  local delta = tonumber(reserved) - used
  local n = redis.call('HGET', KEYS[3], rid)
  -- (Skipping zeros also keeps Lua's "-0" away from Redis, which refuses it as an integer.)
  if n and delta ~= 0 then
    local d = math.min(delta, tonumber(n))
    redis.call('HINCRBY', KEYS[3], rid, 0 - d)
    redis.call('DECRBY', KEYS[4], d)
  end
  local daykey = KEYS[6] .. ':' .. day
  local dsum = redis.call('GET', daykey)
  if dsum and delta ~= 0 then redis.call('DECRBY', daykey, math.min(delta, tonumber(dsum))) end
  redis.call('HSET', KEYS[7], rid, used .. '|' .. day .. '|' .. used)
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
  -- Leases nobody renewed (their gateway died): settle at the last reported use, refund the rest.
  for _, rid in ipairs(redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now)) do
    local v = redis.call('HGET', KEYS[7], rid)
    if v then
      settle(rid, tonumber(string.match(v, '|(%d+)$')))
      redis.call('HDEL', KEYS[7], rid)
    end
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', now)
end
"""

_ADMIT_LUA = _COMMON_LUA + """
local rid, tokens = ARGV[1], tonumber(ARGV[2])
local rpm, tpm, conc, tpd = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local ttl, window, daylen, deadline = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local now = now_ms()
if deadline > 0 and now > deadline then return {0, 'deadline_passed', 0, 0, 0, now} end
expire(now, window)
local day = math.floor(now / daylen)
local daykey = KEYS[6] .. ':' .. day
local nreq = redis.call('ZCARD', KEYS[1])
local tsum = tonumber(redis.call('GET', KEYS[4]) or '0')
if redis.call('HEXISTS', KEYS[7], rid) == 1 then return {1, '', 0, nreq, tsum, now} end  -- a retried script
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
redis.call('HSET', KEYS[7], rid, tokens .. '|' .. day .. '|0')
redis.call('INCRBY', daykey, tokens)
for i = 1, 4 do redis.call('PEXPIRE', KEYS[i], window + 1000) end
-- Leases and reservations outlive their TTL until a later script reaps and settles them.
redis.call('PEXPIRE', KEYS[5], 2 * daylen)
redis.call('PEXPIRE', KEYS[7], 2 * daylen)
redis.call('PEXPIRE', daykey, 2 * daylen)
return {1, '', 0, nreq, tsum, now}
"""

_COMPLETE_LUA = _COMMON_LUA + """
local rid, used = ARGV[1], tonumber(ARGV[2])
redis.call('ZREM', KEYS[5], rid)
settle(rid, used)
redis.call('HDEL', KEYS[7], rid)
return 1
"""

_RENEW_LUA = """
local t = redis.call('TIME')
local expires = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV, 2 do
  local rid = ARGV[i]
  if redis.call('ZSCORE', KEYS[5], rid) then
    redis.call('ZADD', KEYS[5], 'XX', expires, rid)
    local v = redis.call('HGET', KEYS[7], rid)
    if v then
      local reserved, day = string.match(v, '^(%d+)|(%d+)|')
      redis.call('HSET', KEYS[7], rid, reserved .. '|' .. day .. '|' .. ARGV[i + 1])
    end
  end
end
return 1
"""

_VOID_LUA = _COMMON_LUA + """
local rid = ARGV[1]
if redis.call('HEXISTS', KEYS[7], rid) == 0 then return 0 end
settle(rid, 0)
redis.call('ZREM', KEYS[5], rid)
redis.call('ZREM', KEYS[1], rid)
redis.call('ZREM', KEYS[2], rid)
redis.call('HDEL', KEYS[3], rid)
redis.call('HDEL', KEYS[7], rid)
return 1
"""

_CHARGE_LUA = _COMMON_LUA + """
local rid, used, window, daylen = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
-- A marker makes a replayed charge (its first answer was lost) count once.
if not redis.call('SET', KEYS[6] .. ':charged:' .. rid, 1, 'NX', 'PX', window * 10) then return 0 end
local now = now_ms()
local daykey = KEYS[6] .. ':' .. math.floor(now / daylen)
redis.call('ZADD', KEYS[1], now, rid)
redis.call('ZADD', KEYS[2], now, rid)
redis.call('HSET', KEYS[3], rid, used)
redis.call('INCRBY', KEYS[4], used)
redis.call('INCRBY', daykey, used)
for i = 1, 4 do redis.call('PEXPIRE', KEYS[i], window + 1000) end
redis.call('PEXPIRE', daykey, 2 * daylen)
return 1
"""

_PEEK_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[1]))
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {redis.call('ZCARD', KEYS[1]), first[2] or now, now}
"""

_USAGE_LUA = _COMMON_LUA + """
local now = now_ms()
expire(now, tonumber(ARGV[1]))
local day = math.floor(now / tonumber(ARGV[2]))
return {redis.call('ZCARD', KEYS[1]), tonumber(redis.call('GET', KEYS[4]) or '0'),
        redis.call('ZCARD', KEYS[5]), tonumber(redis.call('GET', KEYS[6] .. ':' .. day) or '0')}
"""


class RedisQuotaStore:
    """`timeout_s` bounds each try of a command (one quick retry covers a connection Redis closed
    while idle); `max_connections` bounds the connections of this gateway."""

    def __init__(self, url: str, prefix: str = "kvrelay:quota", timeout_s: float = 0.5, max_connections: int = 64):
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        # The semaphore is the queue (it honours each request's deadline); the pool's own timeout
        # is only a backstop, since the semaphore never lets more commands through than it has connections.
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=60, socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1), health_check_interval=0)
        self._redis = aioredis.Redis(connection_pool=pool)
        self._slots = asyncio.Semaphore(max_connections)
        self.op_timeout_s = 2 * timeout_s + 0.05  # two tries, then the gateway stops waiting
        self._skew_ms = 0  # Redis clock minus ours, learnt when a deadline looked passed too early
        self.prefix = prefix
        self._admit = self._redis.register_script(_ADMIT_LUA)
        self._complete = self._redis.register_script(_COMPLETE_LUA)
        self._renew = self._redis.register_script(_RENEW_LUA)
        self._void = self._redis.register_script(_VOID_LUA)
        self._charge = self._redis.register_script(_CHARGE_LUA)
        self._usage = self._redis.register_script(_USAGE_LUA)
        self._peek = self._redis.register_script(_PEEK_LUA)

    def keys(self, tenant_id: str) -> list[str]:
        # The {tenant} hash tag keeps one tenant's keys in one Redis Cluster slot.
        base = f"{self.prefix}:{{{tenant_id}}}"
        return [f"{base}:req", f"{base}:tok", f"{base}:tokn", f"{base}:toksum", f"{base}:lease", f"{base}:day",
                f"{base}:resv"]

    async def _run(self, script, keys, args, deadline_s: float | None = None):
        """Run a script once a connection is free; waiting past `deadline_s` raises QuotaStoreBusy."""
        from redis.exceptions import RedisError

        try:
            async with asyncio.timeout(None if deadline_s is None else max(0.0, deadline_s - time.time())):
                await self._slots.acquire()
        except TimeoutError:
            raise QuotaStoreBusy("every quota store connection stayed busy until the request's deadline") from None
        try:
            async with asyncio.timeout(self.op_timeout_s):
                return await script(keys=keys, args=args() if callable(args) else args)
        except (RedisError, OSError, TimeoutError) as e:
            raise QuotaStoreUnavailable(f"quota store (Redis) unavailable: {type(e).__name__}: {e}") from e
        finally:
            self._slots.release()

    async def admit(self, tenant_id, quotas, request_id, tokens, lease_ttl_ms, deadline_s=None) -> Decision:
        limits = [limit_arg(quotas.requests_per_minute), limit_arg(quotas.tokens_per_minute),
                  limit_arg(quotas.concurrent_requests), limit_arg(quotas.tokens_per_day)]
        for _ in range(2):
            sent: list[float] = []

            def args(sent: list[float] = sent) -> list:
                # Redis may act on it only while we still wait for the answer (our clock, shifted to Redis's).
                sent.append(time.time())
                until = min(sent[0] + self.op_timeout_s, deadline_s or math.inf)
                redis_deadline = int(until * 1000) + self._skew_ms
                return [request_id, tokens, *limits, lease_ttl_ms, WINDOW_MS, DAY_MS, redis_deadline]

            ok, limit, retry, nreq, tsum, now = await self._run(self._admit, self.keys(tenant_id), args, deadline_s)
            limit = limit.decode() if isinstance(limit, bytes) else limit
            d = Decision(bool(ok), limit or None, int(retry), int(nreq), int(tsum), int(now))
            if d.limit != DEADLINE_PASSED or time.time() > min(sent[0] + self.op_timeout_s, deadline_s or math.inf):
                return d
            # Refused although we were still waiting: Redis's clock runs ahead of ours. Learn it, retry once.
            self._skew_ms = d.now_ms - int(time.time() * 1000)
        return d

    async def complete(self, tenant_id, request_id, used) -> None:
        await self._run(self._complete, self.keys(tenant_id), [request_id, max(0, used)])

    async def renew(self, tenant_id, used_by_request, lease_ttl_ms) -> None:
        if used_by_request:
            flat = [x for rid, used in used_by_request.items() for x in (rid, used)]
            await self._run(self._renew, self.keys(tenant_id), [lease_ttl_ms, *flat])

    async def void(self, tenant_id, request_id) -> None:
        await self._run(self._void, self.keys(tenant_id), [request_id])

    async def charge(self, tenant_id, request_id, used) -> None:
        await self._run(self._charge, self.keys(tenant_id), [request_id, used, WINDOW_MS, DAY_MS])

    async def requests_in_window(self, tenant_id, deadline_s=None) -> tuple[int, int, int]:
        count, oldest, now = await self._run(self._peek, self.keys(tenant_id)[:1], [WINDOW_MS], deadline_s)
        return int(count), int(float(oldest)), int(now)

    async def usage(self, tenant_id) -> dict[str, int]:
        values = await self._run(self._usage, self.keys(tenant_id), [WINDOW_MS, DAY_MS])
        return dict(zip(LIMITS, (int(v) for v in values)))

    async def close(self) -> None:
        await self._redis.aclose()
        await self._redis.connection_pool.disconnect()
