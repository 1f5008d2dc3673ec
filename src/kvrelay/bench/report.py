"""What a run prints and writes: rich tables on the terminal, and the JSON result file.

The result file holds the configuration, one entry per load level (its summary, the server's
figures and every request's timings), so runs can be compared and plotted later.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvrelay.bench.load import Run

RESULT_VERSION = 1


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.2f}"


def mib(v: float | None) -> str:
    return "-" if v is None else f"{v / 2**20:.1f} MiB"


def num(v: float | None, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def summary_table(summary: dict, server: dict, title: str) -> Table:
    t = Table(title=title, show_header=False, title_justify="left", pad_edge=False)
    t.add_column("metric", style="bold")
    t.add_column("value", justify="right")
    s = summary
    t.add_row("requests completed / failed", f"{s['completed']} / {s['failed']}")
    t.add_row("duration", f"{s['duration_s']:.2f} s")
    t.add_row("input / output tokens", f"{s['total_input_tokens']} / {s['total_output_tokens']}")
    t.add_row("request throughput", f"{s['request_throughput']:.2f} req/s")
    t.add_row("output token throughput", f"{s['output_throughput']:.1f} tok/s")
    t.add_row("total token throughput", f"{s['total_token_throughput']:.1f} tok/s")
    if s["slo"]:
        slo = ", ".join(f"{k}<={v:g}s" for k, v in s["slo"].items())
        t.add_row(f"goodput ({slo})", f"{s['goodput']:.2f} req/s ({s['good_requests']} requests)")
    if s["cost_per_million_output_tokens"] is not None:
        t.add_row(
            "cost per 1M output tokens",
            f"{s['cost_per_million_output_tokens']:.4f} (at {s['cost_per_hour']:g}/hour)",
        )
    if s["errors"]:
        t.add_row("errors", ", ".join(f"{k}: {v}" for k, v in s["errors"].items()))
    rl = s["rate_limits"]
    if rl["responses_429"]:
        t.add_row("429 answers (with Retry-After)", f"{rl['responses_429']} ({rl['with_retry_after']})")
        t.add_row(
            "retried after the advised wait / succeeded",
            f"{rl['retries_after_wait']} / {rl['retries_that_succeeded']}",
        )
        t.add_row(
            "advice too short (429 again) / gave up", f"{rl['advice_too_short']} / {rl['requests_given_up']}"
        )
    t.add_row("server peak RSS", mib(server.get("peak_rss_bytes")))
    kv = server.get("peak_kv_usage")
    t.add_row("server peak KV cache usage", "-" if kv is None else f"{kv * 100:.2f} %")
    for key, value in server.get("counter_deltas", {}).items():
        t.add_row(f"server {key.replace('_', ' ')}", f"{value:g}")
    return t


def latency_table(summary: dict) -> Table:
    t = Table(title="latency (ms)", title_justify="left")
    t.add_column("")
    for col in ("mean", "p50", "p90", "p95", "p99", "max"):
        t.add_column(col, justify="right")
    for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        d = summary[key]
        t.add_row(name, *(ms(d[c]) for c in ("mean", "p50", "p90", "p95", "p99", "max")))
    return t


def tenant_table(summary: dict) -> Table | None:
    if not summary.get("tenants"):
        return None
    t = Table(title="per tenant", title_justify="left")
    for col in (
        "tenant",
        "requests",
        "completed",
        "out tok/s",
        "429s",
        "TTFT p99 ms",
        "E2E p99 ms",
        "errors",
    ):
        t.add_column(col, justify="left" if col in ("tenant", "errors") else "right")
    for name, s in summary["tenants"].items():
        t.add_row(
            name,
            str(s["requests"]),
            str(s["completed"]),
            f"{s['output_throughput']:.1f}",
            str(s["responses_429"]),
            ms(s["ttft_p99_s"]),
            ms(s["e2e_p99_s"]),
            ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "-",
        )
    return t


def sweep_table(entries: list[dict]) -> Table:
    t = Table(title="sweep", title_justify="left")
    for col in (
        "load",
        "req/s",
        "out tok/s",
        "goodput",
        "TTFT p50",
        "TTFT p99",
        "TPOT p99",
        "E2E p99",
        "failed",
    ):
        t.add_column(col, justify="right", no_wrap=True)
    for e in entries:
        s = e["summary"]
        t.add_row(
            e["load"]["label"],
            f"{s['request_throughput']:.2f}",
            f"{s['output_throughput']:.1f}",
            f"{s['goodput']:.2f}",
            ms(s["ttft_s"]["p50"]),
            ms(s["ttft_s"]["p99"]),
            ms(s["tpot_s"]["p99"]),
            ms(s["e2e_s"]["p99"]),
            str(s["failed"]),
        )
    return t


def print_entry(console: Console, entry: dict) -> None:
    console.print(
        summary_table(entry["summary"], entry["server"], f"kvrelay bench: {entry['load']['label']}")
    )
    console.print(latency_table(entry["summary"]))
    tenants = tenant_table(entry["summary"])
    if tenants is not None:
        console.print(tenants)


def entry(run: Run, summary: dict, server: dict) -> dict:
    shape = run.shape
    return {
        "load": {
            "label": shape.label(),
            "request_rate": None if shape.request_rate == float("inf") else shape.request_rate,
            "burstiness": shape.burstiness,
            "max_concurrency": shape.max_concurrency,
        },
        "summary": summary,
        "server": server,
        "requests": [r.to_json() for r in sorted(run.results, key=lambda r: r.index)],
    }


def write_result(path: str, config: dict, entries: list[dict], extra: dict | None = None) -> None:
    doc = {
        "version": RESULT_VERSION,
        "tool": "kvrelay bench",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "config": config,
        "runs": entries,
        **(extra or {}),
    }
    Path(path).write_text(json.dumps(doc, indent=1))


def read_result(path: str) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable kvrelay bench result file ({e})") from e
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list):
        raise ValueError(f'{path}: not a kvrelay bench result file (no "runs" list)')  # noqa: TRY004
    return doc
