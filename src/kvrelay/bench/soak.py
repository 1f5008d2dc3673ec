"""`kvrelay bench serve --soak 30m`: hold a steady load and watch for decay.

Every --report-interval it prints the window's requests, errors, p99 end-to-end latency (and its
drift from the first window) and the server's RSS. The exit code is 1 when the run's error rate
passes --max-error-rate, or the server's RSS grew past --max-rss-growth from the first report:
CI and users gate on it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

import aiohttp
from rich.console import Console

from kvrelay.bench.load import LoadShape, Run, Workload, run_load, warm_up
from kvrelay.bench.report import entry, print_entry, write_result
from kvrelay.bench.server_metrics import Sampler, ServerMetrics
from kvrelay.bench.stats import distribution, summarize


@dataclass
class Window:
    t_s: float  # end of the window, since the soak began
    requests: int
    errors: int
    error_rate: float
    e2e_p99_s: float | None
    p99_drift: float | None  # this window's p99 / the first window's - 1
    rss_bytes: float | None


@dataclass
class Verdict:
    error_rate: float
    rss_growth: float | None
    failures: list[str]

    @property
    def passed(self) -> bool:
        return not self.failures


def judge(
    windows: list[Window], total: int, failed: int, max_error_rate: float | None, max_rss_growth: float | None
) -> Verdict:
    error_rate = failed / total if total else 1.0
    rss = [w.rss_bytes for w in windows if w.rss_bytes is not None]
    growth = (rss[-1] - rss[0]) / rss[0] if len(rss) >= 2 and rss[0] else None
    failures = []
    if total == 0:
        failures.append("no request finished")
    if max_error_rate is not None and error_rate > max_error_rate:
        failures.append(f"error rate {error_rate:.2%} > --max-error-rate {max_error_rate:.2%}")
    if max_rss_growth is not None:
        if growth is None:
            failures.append(
                "--max-rss-growth: the server's RSS was not seen twice (no process_resident_memory_bytes "
                "in its /metrics; give --server-pid for a local server)"
            )
        elif growth > max_rss_growth:
            failures.append(f"server RSS grew {growth:.1%} > --max-rss-growth {max_rss_growth:.1%}")
    return Verdict(error_rate, growth, failures)


def _window(results, t: float, first_p99: float | None, rss: float | None) -> Window:
    errors = sum(1 for r in results if not r.ok)
    p99 = distribution(r.e2e for r in results if r.ok)["p99"]
    drift = p99 / first_p99 - 1 if p99 is not None and first_p99 else None
    return Window(t, len(results), errors, errors / len(results) if results else 0.0, p99, drift, rss)


def _line(w: Window) -> str:
    p99 = "-" if w.e2e_p99_s is None else f"{w.e2e_p99_s * 1000:.1f} ms"
    drift = "" if w.p99_drift is None else f" ({w.p99_drift:+.1%})"
    rss = "-" if w.rss_bytes is None else f"{w.rss_bytes / 2**20:.1f} MiB"
    return (
        f"soak {w.t_s:7.1f} s: {w.requests} requests, {w.errors} errors ({w.error_rate:.1%}), "
        f"E2E p99 {p99}{drift}, server RSS {rss}"
    )


async def run_soak(
    http: aiohttp.ClientSession,
    work: Workload,
    shape: LoadShape,
    args,
    server: ServerMetrics,
    slo: dict,
    console: Console,
    config: dict,
) -> int:
    await warm_up(http, work, args.warmup, shape.max_concurrency)
    console.print(f"soak: {shape.label()} for {args.soak:g} s, a report every {args.report_interval:g} s")
    run = Run(shape)
    sampler = Sampler(server, args.metrics_interval)  # peaks and counter deltas over the whole soak
    await sampler.start(http)
    task = asyncio.create_task(run_load(http, work, shape, None, args.soak, None, run))
    windows: list[Window] = []
    seen = 0
    start = time.perf_counter()
    while True:
        done, _ = await asyncio.wait({task}, timeout=args.report_interval)
        new = run.results[seen:]
        seen += len(new)
        if new or not done:
            snap = await server.snapshot(http)
            first_p99 = windows[0].e2e_p99_s if windows else None
            windows.append(_window(new, time.perf_counter() - start, first_p99, snap.rss_bytes))
            console.print(_line(windows[-1]))
        if done:
            break
    task.result()
    await sampler.stop(http)
    summary = summarize(run.results, run.duration_s, slo, args.cost_per_hour)
    verdict = judge(windows, summary["requests"], summary["failed"], args.max_error_rate, args.max_rss_growth)
    e = entry(run, summary, sampler.summary())
    print_entry(console, e)
    growth = "-" if verdict.rss_growth is None else f"{verdict.rss_growth:+.1%}"
    console.print(
        f"soak: error rate {verdict.error_rate:.2%}, server RSS growth {growth}: "
        + ("[green]PASS[/]" if verdict.passed else "[red]FAIL[/]: " + "; ".join(verdict.failures))
    )
    if args.result_file:
        write_result(
            args.result_file,
            config,
            [e],
            {
                "soak": {
                    "windows": [asdict(w) for w in windows],
                    "verdict": asdict(verdict) | {"passed": verdict.passed},
                }
            },
        )
    if args.plot:
        from kvrelay.bench.plot import plot_runs

        plot_runs([e], args.plot)
    return 0 if verdict.passed else 1
