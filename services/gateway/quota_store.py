"""What every quota store shares: the decision type, the errors, the store protocol, the headers.

A store keeps, per tenant, a sliding 60 s log of requests and of tokens, a counter per UTC
day, and concurrency leases. Each lease carries its reservation (tokens reserved, tokens
used so far as last reported by its gateway, and the day charged), so a lease that
expires without a reconcile (its gateway died) is settled: the unused part is refunded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from kvrelay.gateway.tenants import Quotas

WINDOW_MS = 60_000
DAY_MS = 86_400_000
LIMITS = ("requests_per_minute", "tokens_per_minute", "concurrent_requests", "tokens_per_day")
DEADLINE_PASSED = "deadline_passed"  # the store saw the admission after its deadline: nothing taken


class QuotaExceeded(Exception):
    def __init__(self, limit: str, retry_after_s: float, headers: dict[str, str]):
        super().__init__(f"{limit} quota exceeded; retry after {retry_after_s:.1f} s")
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.headers = headers


class QuotaStoreUnavailable(Exception):
    """The quota store (Redis) could not be reached, answered with an error, or answered too late."""


class QuotaStoreBusy(Exception):
    """Every connection to the store stayed busy until the request's deadline (back-pressure, not a
    store failure: the failure policy does not apply)."""


@dataclass
class Decision:
    """The raw outcome both stores compute; headers are derived from it in one place."""

    admitted: bool
    limit: str | None  # which limit rejected (or DEADLINE_PASSED)
    retry_after_ms: int
    requests_in_window: int
    tokens_in_window: int
    now_ms: int


def limit_arg(value: int | None) -> int:
    return -1 if value is None else int(value)


def rate_headers(q: Quotas, d: Decision, tokens: int) -> dict[str, str]:
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
                    lease_ttl_ms: int, deadline_s: float | None = None) -> Decision:
        """Reserve one request and `tokens` under a lease; `deadline_s` (unix time) bounds both the
        wait for a connection and when the store may still act on it."""
        ...

    async def complete(self, tenant_id: str, request_id: str, used: int) -> None:
        """Drop the lease and settle the reservation at `used` tokens (refund or charge the difference)."""
        ...

    async def renew(self, tenant_id: str, used_by_request: dict[str, int], lease_ttl_ms: int) -> None:
        """Extend live leases and record each one's tokens used so far (what a reap would charge)."""
        ...

    async def void(self, tenant_id: str, request_id: str) -> None:
        """Undo an admission whose outcome the gateway never learned (the request was not served)."""
        ...

    async def charge(self, tenant_id: str, request_id: str, used: int) -> None:
        """Record a request served without the store (fail-open) now that it answers again."""
        ...

    async def requests_in_window(self, tenant_id: str, deadline_s: float | None = None) -> tuple[int, int, int]:
        """(requests in the last minute, when the oldest was admitted, now), in ms; changes nothing."""
        ...

    async def usage(self, tenant_id: str) -> dict[str, int]: ...
    async def close(self) -> None: ...
