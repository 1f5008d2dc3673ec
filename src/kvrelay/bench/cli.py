"""`kvrelay bench`: serve (a server over HTTP), throughput (the engine offline), compare (result files)."""

from __future__ import annotations

import argparse
import importlib

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": (
        "kvrelay.bench.serve",
        "load any OpenAI-compatible server and measure latency, throughput, goodput",
    ),
    "throughput": ("kvrelay.bench.throughput", "offline engine throughput of a model folder, no HTTP"),
    "compare": ("kvrelay.bench.compare", "two result files side by side, with ratios"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(
            name,
            help=help_text,
            description=(module.__doc__ or help_text).strip(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        p.set_defaults(bench_run=module.run)


def run(args: argparse.Namespace) -> int:
    return int(args.bench_run(args) or 0)
