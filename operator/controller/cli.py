"""`kvrelay operator`: run the kopf operator for InferenceService resources.

Several replicas elect one leader through kopf peering: each replica joins the
ClusterKopfPeering `kvrelay-operator` with a distinct random priority; only the highest-priority
live replica handles resources, the others stand by and take over when its heartbeat expires.
Without --standalone, a missing peering object stops the operator with a message (peering.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random

from kvrelay.operator import constants


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", "-n", action="append", default=[],
                        help="watch only this namespace (repeatable); default: all namespaces")
    parser.add_argument("--peering", default=constants.PEERING_NAME,
                        help="kopf peering object used for leader election (default: %(default)s)")
    parser.add_argument("--standalone", action="store_true",
                        help="no leader election: for a single replica or local development")
    parser.add_argument("--priority", type=int, default=None,
                        help="peering priority; default: random, so exactly one replica leads")
    parser.add_argument("--peering-lifetime", type=int, default=60, metavar="SECONDS",
                        help="how long a replica's peering heartbeat counts as alive; a standby takes over "
                             "this long after the leader's last heartbeat (default: %(default)s)")
    parser.add_argument("--liveness", default="http://0.0.0.0:8080/healthz",
                        help="liveness endpoint URL served by kopf (empty to disable)")
    parser.add_argument("--verbose", action="store_true", help="debug logging")


def run(args: argparse.Namespace) -> int:
    # --namespace without --standalone is refused by preflight.check, before this runs.
    import kopf
    import kvrelay.operator.handlers  # noqa: F401  (registers the handlers)

    kopf.configure(verbose=args.verbose, log_prefix=True)  # "[namespace/name] ..." on per-object lines
    logging.getLogger("kvrelay").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    priority = args.priority if args.priority is not None else random.SystemRandom().randint(1, 2**31 - 1)
    settings = kopf.OperatorSettings()
    settings.peering.lifetime = args.peering_lifetime
    stop = asyncio.Event()  # binds to kopf's loop on first use (a threading.Event would block exit)
    memo = kopf.Memo(stop_flag=stop)  # a start-up check that fails sets startup_error and the flag
    kopf.run(
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        standalone=args.standalone,
        # Naming a peering makes kopf wait for it even when standalone: name it only when electing.
        peering_name=None if args.standalone else args.peering,
        priority=priority,
        settings=settings,
        memo=memo,
        stop_flag=stop,
        liveness_endpoint=args.liveness or None,
    )
    if memo.get("startup_error"):
        raise SystemExit(f"kvrelay operator: {memo.startup_error}")
    return 0
