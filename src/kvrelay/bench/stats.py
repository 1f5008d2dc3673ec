"""Statistics of a run: latency distributions, throughput, goodput, errors, cost.

Percentiles are numpy's default (linear interpolation between closest ranks), as in vLLM's
benchmark, so figures from both tools compare. Latencies are in seconds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import numpy as np

from kvrelay.bench.client import RequestResult

PERCENTILES = (50, 90, 95, 99)
SLO_KEYS = ("ttft", "tpot", "itl", "e2e")


def distribution(values: Iterable[float]) -> dict[str, float | None]:
    """mean, p50, p90, p95, p99 and max of values (all None when there are none)."""
    arr = np.asarray([v for v in values if v is not None], dtype=float)
    keys = ["mean"] + [f"p{p}" for p in PERCENTILES] + ["max"]
    if arr.size == 0:
        return dict.fromkeys(keys)
    out = {"mean": float(arr.mean())}
    out.update({f"p{p}": float(v) for p, v in zip(PERCENTILES, np.percentile(arr, PERCENTILES))})
    out["max"] = float(arr.max())
    return out


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=0.5,tpot=0.05' -> {'ttft': 0.5, 'tpot': 0.05} (seconds)."""
    if not text:
        return {}
    slo = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(
                f"--slo {text!r}: expected KEY=SECONDS[,...] with KEY one of {', '.join(SLO_KEYS)}"
            )
        try:
            slo[key] = float(value)
        except ValueError:
            raise ValueError(f"--slo {text!r}: {value!r} is not a number of seconds") from None
    return slo


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    if not r.ok:
        return False
    checks = {"ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e, "itl": max(r.itl) if r.itl else None}
    return all(checks[k] is None or checks[k] <= limit for k, limit in slo.items())


def rate_limit_summary(results: list[RequestResult]) -> dict:
    """429s, whether they said when to retry, and whether waiting that long was enough."""
    answers = sum(r.rate_limited for r in results)
    advised = sum(1 for r in results for a in r.retry_after if a is not None)
    retried = sum(r.retries_after_wait for r in results)
    # Every 429 after the first one answered a retry sent after the advised wait: too short.
    too_short = sum(max(0, r.rate_limited - 1) for r in results)
    succeeded = sum(1 for r in results if r.retries_after_wait and r.ok)
    return {
        "responses_429": answers,
        "with_retry_after": advised,
        "retries_after_wait": retried,
        "retries_that_succeeded": succeeded,
        "advice_too_short": too_short,
        "requests_given_up": sum(1 for r in results if r.error == "http_429"),
    }


def summarize(
    results: list[RequestResult],
    duration_s: float,
    slo: dict[str, float] | None = None,
    cost_per_hour: float | None = None,
) -> dict:
    ok = [r for r in results if r.ok]
    duration_s = max(duration_s, 1e-9)
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    status = Counter(str(r.status) if r.status is not None else "none" for r in results)
    errors = Counter(r.error for r in results if r.error)
    good = sum(1 for r in ok if meets_slo(r, slo or {}))
    summary = {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "usage_reported": sum(1 for r in ok if r.usage_reported),
        "request_throughput": len(ok) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "ttft_s": distribution(r.ttft for r in ok),
        "tpot_s": distribution(r.tpot for r in ok),
        "itl_s": distribution(x for r in ok for x in r.itl),
        "e2e_s": distribution(r.e2e for r in ok),
        "slo": slo or {},
        "goodput": good / duration_s,
        "good_requests": good,
        "status_counts": dict(sorted(status.items())),
        "errors": dict(sorted(errors.items())),
        "rate_limits": rate_limit_summary(results),
        "cost_per_hour": cost_per_hour,
        "cost_per_million_output_tokens": None,
    }
    if cost_per_hour is not None and out_tokens:
        summary["cost_per_million_output_tokens"] = cost_per_hour * duration_s / 3600 / out_tokens * 1e6
    tenants = sorted({r.tenant for r in results if r.tenant is not None})
    if tenants:
        summary["tenants"] = {
            t: _tenant_summary([r for r in results if r.tenant == t], duration_s) for t in tenants
        }
    return summary


def _tenant_summary(results: list[RequestResult], duration_s: float) -> dict:
    ok = [r for r in results if r.ok]
    return {
        "requests": len(results),
        "completed": len(ok),
        "output_throughput": sum(r.output_tokens or 0 for r in ok) / duration_s,
        "responses_429": sum(r.rate_limited for r in results),
        "errors": dict(Counter(r.error for r in results if r.error)),
        "ttft_p99_s": distribution(r.ttft for r in ok)["p99"],
        "e2e_p99_s": distribution(r.e2e for r in ok)["p99"],
    }
