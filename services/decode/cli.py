"""`kvrelay decode`: serve DecodeService (and the load stream) for the gateway."""

from __future__ import annotations

import argparse
import asyncio
import logging

from kvrelay.kvtransfer.worker_base import add_worker_args, serve_forever


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_worker_args(parser, "decode")


def run(args: argparse.Namespace) -> int:
    from kvrelay.decode.worker import DecodeWorker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve_forever(DecodeWorker, args))
