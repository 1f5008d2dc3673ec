"""Request deadlines: every request has one (`--request-timeout`, capped by its tenant's
`request_timeout_s`), counted from its arrival.

The gateway cancels a request whose deadline passes (the backend iterator closes: the engine, or
the decode worker and through it the prefill worker, abort and free its blocks) and answers 504
in OpenAI's error shape, or an SSE error event once streaming began. Towards the workers the
deadline travels as the gRPC deadline of the decode call (read by backends from `DEADLINE`); the
decode worker passes what is left of it on to its prefill call.
"""

from __future__ import annotations

import time
from contextvars import ContextVar

from kvrelay.gateway.errors import ApiError

# The current request's deadline on time.monotonic()'s clock; None: no deadline.
DEADLINE: ContextVar[float | None] = ContextVar("kvrelay_deadline", default=None)


def request_timeout(default_s: float | None, tenant_cap_s: float | None) -> float | None:
    """The gateway's timeout, capped by the tenant's (None: that side sets no bound)."""
    bounds = [t for t in (default_s, tenant_cap_s) if t is not None and t > 0]
    return min(bounds) if bounds else None


def remaining(now: float | None = None) -> float | None:
    """Seconds left before the current request's deadline (never below a millisecond); None: none."""
    deadline = DEADLINE.get()
    if deadline is None:
        return None
    return max(0.001, deadline - (time.monotonic() if now is None else now))


def deadline_exceeded(timeout_s: float) -> ApiError:
    return ApiError(504, f"The request did not complete within its deadline of {timeout_s:g} s "
                         "(--request-timeout, or the tenant's request_timeout_s); it was aborted",
                    "timeout_error", None, "request_timeout")
