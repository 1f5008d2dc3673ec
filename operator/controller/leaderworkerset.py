"""A role whose engine spans several nodes: a LeaderWorkerSet instead of a Deployment.

When spec.<role>.parallelism asks for more GPUs than gpusPerNode, each replica of the role is a
group of `nodes` pods (LeaderWorkerSet `size`), gpusPerNode GPUs each. The leader pod runs the
role's usual command with `--nnodes N --dist-init-addr $(LWS_LEADER_ADDRESS):29500` (node 0: the
engine, its gRPC and metrics ports, its probes); the worker pods run `kvrelay parallel-worker
--node-rank $(LWS_WORKER_INDEX)` pointed at the same address. Every pod reads the nodes' shared token
from the Secret `<name>-parallel-token`, created once with a random value. Worker pods carry the
component label `<role>-node`, so the role's Service (and the gateway) sees the leaders only. A
restarted pod restarts its whole group (RecreateGroupOnPodRestart): the engine cannot lose a rank.
"""

from __future__ import annotations

import copy
import secrets
from typing import Any

from kvrelay.operator import constants as c
from kvrelay.operator.builders import build_deployment, labels, owner_reference
from kvrelay.operator.config import OperatorConfig
from kvrelay.operator.spec import InferenceServiceSpec, InvalidSpec


def uses_lws(spec: InferenceServiceSpec, role: str) -> bool:
    return role in c.WORKER_ROLES and spec.role(role).parallelism.nodes > 1


def token_secret_name(owner_name: str) -> str:
    return f"{owner_name}-parallel-token"


def missing_crd_error(spec: InferenceServiceSpec) -> InvalidSpec:
    role = next(r for r in c.WORKER_ROLES if uses_lws(spec, r))
    par = spec.role(role).parallelism
    return InvalidSpec(f"spec.{role}.parallelism: tensor x pipeline = {par.gpus} GPUs over {par.nodes} nodes "
                       f"(gpusPerNode {par.gpus_per_node}) needs a LeaderWorkerSet, but the CRD {c.LWS_CRD} is "
                       f"not installed in this cluster; install LeaderWorkerSet (https://lws.sigs.k8s.io) or fit "
                       f"the engine on one node")


def _env_token(owner_name: str) -> dict[str, Any]:
    return {"name": c.PARALLEL_TOKEN_ENV, "valueFrom": {"secretKeyRef": {
        "name": token_secret_name(owner_name), "key": c.PARALLEL_TOKEN_KEY}}}


def build_token_secret(owner, token: str | None = None) -> dict[str, Any]:
    """The nodes' shared token (a fresh random one unless given): created once, never rewritten."""
    return {
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": token_secret_name(owner.name), "namespace": owner.namespace, "labels": labels(owner),
                     "ownerReferences": [owner_reference(owner)]},
        "type": "Opaque",
        "stringData": {c.PARALLEL_TOKEN_KEY: token or secrets.token_urlsafe(32)},
    }


# LWS names its StatefulSets <name> and <name>-<group>, whose pods' revision-hash labels (name + 11
# characters) must stay within 63.
MAX_LWS_NAME = 48


def build_leader_worker_set(owner, role: str, spec: InferenceServiceSpec, config: OperatorConfig,
                            replicas: int) -> dict[str, Any]:
    par = spec.role(role).parallelism
    name = f"{owner.name}-{role}"
    if len(name) > MAX_LWS_NAME:
        raise InvalidSpec(f"metadata.name: a multi-node {role} role's LeaderWorkerSet {name!r} would be "
                          f"{len(name)} characters; LeaderWorkerSet names fit {MAX_LWS_NAME}")
    deployment = build_deployment(owner, role, spec, config, replicas)
    address = f"$({c.LWS_LEADER_ADDRESS_ENV}):{c.PARALLEL_DIST_PORT}"
    nodes = ["--nnodes", str(par.nodes), "--dist-init-addr", address]

    leader = copy.deepcopy(deployment["spec"]["template"])
    engine = leader["spec"]["containers"][0]
    engine["args"] = [*engine["args"], *nodes]
    engine["env"] = [*engine["env"], _env_token(owner.name)]
    engine["ports"] = [*engine["ports"], {"name": "dist", "containerPort": c.PARALLEL_DIST_PORT, "protocol": "TCP"},
                       {"name": "dist-control", "containerPort": c.PARALLEL_DIST_PORT + 1, "protocol": "TCP"}]

    worker = copy.deepcopy(deployment["spec"]["template"])
    worker["metadata"]["labels"] = labels(owner, f"{role}-node")  # not behind the role's Service
    worker["metadata"]["annotations"] = {c.ANNOTATION_CONFIG_HASH: leader["metadata"]["annotations"][
        c.ANNOTATION_CONFIG_HASH]}  # no /metrics to scrape
    node = worker["spec"]["containers"][0]
    node["name"] = f"{role}-node"
    node["args"] = ["parallel-worker", "--nnodes", str(par.nodes), "--node-rank", f"$({c.LWS_WORKER_INDEX_ENV})",
                    "--dist-init-addr", address]
    node["env"] = [{"name": "KVRELAY_ROLE", "value": f"{role}-node"}, _env_token(owner.name),
                   *copy.deepcopy(spec.role(role).env)]
    for key in ("ports", "startupProbe", "readinessProbe", "livenessProbe"):
        node.pop(key, None)  # no server: the process lives as long as its ranks and the engine

    metadata = copy.deepcopy(deployment["metadata"])
    return {
        "apiVersion": c.LWS_API_VERSION,
        "kind": c.LWS_KIND,
        "metadata": metadata,
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": par.nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }


def workload_kinds(spec: InferenceServiceSpec, role: str) -> tuple[tuple[str, str], tuple[str, str]]:
    """((apiVersion, kind) the role runs as, the other one), for scaling a stale one to zero."""
    lws, dep = (c.LWS_API_VERSION, c.LWS_KIND), ("apps/v1", "Deployment")
    return (lws, dep) if uses_lws(spec, role) else (dep, lws)

