"""`kvrelay gateway`: the cluster role, in front of prefill and decode worker pools.

    kvrelay gateway --prefill HOST:PORT,... --decode HOST:PORT,... --redis-url URL --tenants FILE

Workers come from static lists, or from a headless Service's DNS name (re-resolved
periodically, see `kvrelay.gateway.routing`).
"""

from __future__ import annotations

import argparse

from kvrelay.gateway.serve import add_gateway_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_gateway_arguments(parser, default_port=8000)
    parser.add_argument("--prefill", default="", help="prefill workers: HOST:PORT,... or dns:///SERVICE:PORT")
    parser.add_argument("--decode", default="", help="decode workers: HOST:PORT,... or dns:///SERVICE:PORT")
    parser.add_argument("--dns-refresh", type=float, default=5.0, help="seconds between DNS re-resolutions")


def run(args: argparse.Namespace) -> int:
    from kvrelay.gateway.backend import DisaggregatedBackend

    if not args.prefill or not args.decode:
        raise SystemExit("kvrelay gateway: both --prefill and --decode are required (HOST:PORT,... or dns:///NAME:PORT)")
    try:
        DisaggregatedBackend(args.prefill.split(","), args.decode.split(","))
    except RuntimeError as e:
        raise SystemExit(f"kvrelay gateway: {e}") from e
    return 1
