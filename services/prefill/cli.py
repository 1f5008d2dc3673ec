"""`kvrelay prefill`: serve PrefillService (and the load stream) for decode workers."""

from __future__ import annotations

import argparse
import asyncio

from kvrelay.kvtransfer.worker_base import add_worker_args, serve_forever

from kvrelay.log_format import setup_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_args(parser, "prefill")


def run(args: argparse.Namespace) -> int:
    from kvrelay.prefill.worker import PrefillWorker

    setup_logging(args.log_level, args.log_format)
    return asyncio.run(serve_forever(PrefillWorker, args))
