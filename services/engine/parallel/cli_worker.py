"""`kvrelay parallel-worker`: host this node's tensor/pipeline-parallel ranks for an engine on node 0.

    node 0:  KVRELAY_PARALLEL_TOKEN=s kvrelay serve -tp 2 -pp 2 --nnodes 2 --dist-init-addr 10.0.0.1:29500
    node 1:  KVRELAY_PARALLEL_TOKEN=s kvrelay parallel-worker --nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.1:29500

The model flags come from the engine (its WorkerSpec): the model folder must be at the same path here.
Exits 0 when the engine closes, 1 when one of its ranks dies or the engine is lost.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvrelay.engine.engine_args import add_multinode_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_multinode_args(parser)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def run(args: argparse.Namespace) -> int:
    from kvrelay.engine.parallel.multinode import MultinodeError, parse_layout, run_follower, token_from_env

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.nnodes < 2 or args.node_rank < 1:
            raise MultinodeError("parallel-worker hosts node 1.. of --nnodes >= 2 (node 0 is the engine: "
                                 "`kvrelay serve|generate|prefill|decode --nnodes N --dist-init-addr HOST:PORT`)")
        # The world size is the engine's (its spec says which ranks are this node's).
        layout = parse_layout(args.nnodes, args.node_rank, args.dist_init_addr, args.nnodes)
        return run_follower(layout, token_from_env())
    except MultinodeError as e:
        print(f"kvrelay parallel-worker: error: {e}", file=sys.stderr)
        return 2
