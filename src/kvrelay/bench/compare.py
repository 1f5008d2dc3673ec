"""`kvrelay bench compare A.json B.json`: two result files side by side, with B/A ratios.

Load levels are paired in order (a sweep against a sweep of the same levels, or one run each).
For throughputs a ratio above 1 means B is better; for latencies and cost, below 1.
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console
from rich.table import Table

from kvrelay.bench.report import read_result

ROWS = (
    [  # (label, path into the run entry, scale, format)
        ("completed", ("summary", "completed"), 1, "d"),
        ("failed", ("summary", "failed"), 1, "d"),
        ("request throughput (req/s)", ("summary", "request_throughput"), 1, ".2f"),
        ("output throughput (tok/s)", ("summary", "output_throughput"), 1, ".1f"),
        ("goodput (req/s)", ("summary", "goodput"), 1, ".2f"),
    ]
    + [
        (f"{name} {stat} (ms)", ("summary", key, stat), 1000, ".2f")
        for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E"))
        for stat in ("mean", "p50", "p99")
    ]
    + [
        ("server peak RSS (MiB)", ("server", "peak_rss_bytes"), 1 / 2**20, ".1f"),
        ("server peak KV usage (%)", ("server", "peak_kv_usage"), 100, ".2f"),
        ("cost per 1M output tokens", ("summary", "cost_per_million_output_tokens"), 1, ".4f"),
    ]
)


def pick(entry: dict, path: tuple) -> float | None:
    value = entry
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value if isinstance(value, (int, float)) else None


def compare_table(a: dict, b: dict, name_a: str, name_b: str, title: str) -> Table:
    t = Table(title=title, title_justify="left")
    t.add_column("metric")
    t.add_column(name_a, justify="right")
    t.add_column(name_b, justify="right")
    t.add_column("B/A", justify="right")
    for label, path, scale, fmt in ROWS:
        va, vb = pick(a, path), pick(b, path)
        if va is None and vb is None:
            continue
        shown = [("-" if v is None else format(v * scale if fmt != "d" else v, fmt)) for v in (va, vb)]
        ratio = f"{vb / va:.2f}x" if va and vb is not None else "-"
        t.add_row(label, *shown, ratio)
    return t


def ratios(a: dict, b: dict) -> dict[str, float | None]:
    """B/A of every row both runs have (for scripts and tests)."""
    out = {}
    for label, path, _, _ in ROWS:
        va, vb = pick(a, path), pick(b, path)
        out[label] = vb / va if va and vb is not None else None
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("a", help="result file A (the baseline)")
    p.add_argument("b", help="result file B")


def run(args: argparse.Namespace) -> int:
    console = Console() if sys.stdout.isatty() else Console(width=120)
    try:
        doc_a, doc_b = read_result(args.a), read_result(args.b)
    except ValueError as e:
        print(f"kvrelay bench compare: {e}", file=sys.stderr)
        return 2
    runs_a, runs_b = doc_a["runs"], doc_b["runs"]
    if len(runs_a) != len(runs_b):
        console.print(
            f"[yellow]{args.a} has {len(runs_a)} load levels, {args.b} {len(runs_b)}: "
            f"comparing the first {min(len(runs_a), len(runs_b))}[/]"
        )
    for a, b in zip(runs_a, runs_b):
        la, lb = a["load"]["label"], b["load"]["label"]
        title = la if la == lb else f"{la} vs {lb}"
        console.print(compare_table(a, b, f"A: {args.a}", f"B: {args.b}", title))
    return 0
