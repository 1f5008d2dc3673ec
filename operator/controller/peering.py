"""The start-up check of leader election: the peering object must exist.

kopf, told to elect on a ClusterKopfPeering that does not exist, pauses every watch and waits for
it without a word. `kvrelay operator` checks first and stops with a message that names the object
and how to create it. It does not fall back to standalone: replicas that each decided so would
all reconcile every resource and fight over it.
"""

from __future__ import annotations

import json

import kopf
from kvrelay.operator.kube import APIError, KubeClient, peering_path

START_UP_BACKOFFS = (1, 2)  # a 403 here is missing RBAC, not an API server upgrade: say so in seconds


def missing_message(name: str) -> str:
    peering = json.dumps({"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name}})
    return (f"ClusterKopfPeering {name!r} not found, and leader election needs it (the Helm chart creates it). "
            f"Create it with: kubectl apply -f charts/kvrelay/crds/clusterkopfpeerings.kopf.dev.yaml && "
            f"echo '{peering}' | kubectl create -f -   Or run a single replica with --standalone.")


async def require_peering(client: KubeClient, name: str, memo: kopf.Memo) -> None:
    """Runs as a task started at start-up (kopf logs in only after its start-up handlers). On a
    problem: log it, leave it in memo.startup_error and raise memo.stop_flag, which
    `kvrelay operator` passes to kopf and then turns into its exit message."""
    try:
        found = await client.get(peering_path(name), backoffs=START_UP_BACKOFFS)
        problem = None if found is not None else missing_message(name)
    except APIError as e:
        problem = (f"cannot read ClusterKopfPeering {name!r} ({e}): the operator's account needs get, list, watch "
                   f"and patch on clusterkopfpeerings.kopf.dev (the chart's ClusterRole grants them)")
    if problem is None:
        return
    client.logger.error(problem)
    memo.startup_error = problem
    if memo.get("stop_flag") is not None:
        memo.stop_flag.set()
