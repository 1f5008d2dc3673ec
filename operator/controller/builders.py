"""Desired child objects of one InferenceService: plain dicts ready for server-side apply.

Pure functions of (resource identity, parsed spec, operator config, live replica counts), so
they are unit-tested without a cluster. Every child carries the owner reference (garbage
collection on deletion) and a hash of its own content (an unchanged child is never rewritten).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvrelay.operator import constants as c
from kvrelay.operator.config import OperatorConfig
from kvrelay.operator.spec import InferenceServiceSpec, InvalidSpec, RoleSpec

WORKLOAD_KINDS = ("Deployment", c.LWS_KIND)  # a role's pods: one node each, or a group over several
MAX_NAME_LENGTH = 63 - len("-prefill")  # child Service names must stay valid DNS labels


@dataclass(frozen=True)
class Owner:
    name: str
    namespace: str
    uid: str


def child_name(owner_name: str, role: str) -> str:
    return f"{owner_name}-{role}"


def config_map_name(owner_name: str) -> str:
    return f"{owner_name}-config"


def service_host(owner: Owner, role: str) -> str:
    return f"{child_name(owner.name, role)}.{owner.namespace}.svc.cluster.local"


def gateway_url(owner: Owner) -> str:
    return f"http://{service_host(owner, 'gateway')}:{c.GATEWAY_HTTP_PORT}"


def check_name(name: str) -> None:
    if len(name) > MAX_NAME_LENGTH:
        raise InvalidSpec(f"metadata.name is {len(name)} characters; at most {MAX_NAME_LENGTH} fit child names")


def content_hash(obj: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def labels(owner: Owner, role: str | None = None) -> dict[str, str]:
    out = {
        c.LABEL_NAME: "kvrelay",
        c.LABEL_INSTANCE: owner.name,
        c.LABEL_MANAGED_BY: c.FIELD_MANAGER,
    }
    if role:
        out[c.LABEL_COMPONENT] = role
    return out


def selector(owner: Owner, role: str) -> dict[str, str]:
    return {c.LABEL_INSTANCE: owner.name, c.LABEL_COMPONENT: role}


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(owner: Owner, name: str, role: str | None) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": labels(owner, role),
        "ownerReferences": [owner_reference(owner)],
    }


def settings_data(spec: InferenceServiceSpec) -> dict[str, str]:
    """Settings every role reads from its environment (ConfigMap `<name>-config`)."""
    return {
        "KVRELAY_MODEL_URI": spec.model.uri,
        "KVRELAY_MODEL_NAME": spec.model.name,
        "KVRELAY_DTYPE": spec.model.dtype,
        "KVRELAY_QUANTIZATION": spec.model.quantization,
        "KVRELAY_KV_TRANSPORT": spec.transport,
    }


def build_config_map(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(owner, config_map_name(owner.name), None),
        "data": settings_data(spec),
    }


def _role_command(owner: Owner, role: str, spec: InferenceServiceSpec, config: OperatorConfig) -> list[str]:
    if role in c.WORKER_ROLES:
        args = [role, "--model", spec.model.uri, "--port", str(c.WORKER_GRPC_PORT),
                "--metrics-port", str(c.WORKER_METRICS_PORT),
                "--served-model-name", spec.model.name, "--dtype", spec.model.dtype,
                "--shutdown-timeout", str(spec.role(role).shutdown_timeout_seconds)]
        if spec.model.quantization != "none":
            args += ["--quantization", spec.model.quantization]
        args += _lora_args(spec)
        par = spec.role(role).parallelism
        if par.tensor > 1:
            args += ["--tensor-parallel-size", str(par.tensor)]
        if par.pipeline > 1:
            args += ["--pipeline-parallel-size", str(par.pipeline)]
        if role == "decode" and spec.shared_memory.enabled:
            args += ["--kv-shm-bytes", str(spec.shared_memory.size_bytes), "--kv-shm-dir", c.KV_SHM_MOUNT_DIR]
        if role == "prefill" and spec.shared_memory.enabled and spec.shared_memory.prefill_cache:
            args += ["--kv-shared-cache", "--kv-shm-dir", c.KV_SHM_MOUNT_DIR]
        args += _transport_args(role, spec.transport)
    elif spec.model.runner == "pooling":
        args = _serve_args(spec)
    else:
        args = [
            "gateway",
            "--prefill", f"dns:///{service_host(owner, 'prefill')}:{c.WORKER_GRPC_PORT}",
            "--decode", f"dns:///{service_host(owner, 'decode')}:{c.WORKER_GRPC_PORT}",
            "--host", "0.0.0.0",
            "--port", str(c.GATEWAY_HTTP_PORT),
            # Full metrics (per tenant) on their own port, off the public API port.
            "--metrics-port", str(c.GATEWAY_METRICS_PORT),
            # The gateway tokenizes prompts (quotas, prefix routing) with the model's own tokenizer.
            "--model", spec.model.uri,
            "--served-model-name", spec.model.name, *spec.model.aliases,
            "--shutdown-delay", str(c.GATEWAY_SHUTDOWN_DELAY_S),
            "--shutdown-timeout", str(spec.gateway.shutdown_timeout_seconds),
        ]
        args += _lora_args(spec)  # the gateway reads the adapters' names
    if role == "gateway":
        if spec.redis_url or spec.redis_secret or config.default_redis_url:
            args += ["--redis-url", "$(KVRELAY_REDIS_URL)"]  # expanded by the kubelet from env
        if spec.tenants_secret:
            args += ["--tenants", f"{c.TENANTS_MOUNT_DIR}/{spec.tenants_secret.key}"]
    return args + list(spec.role(role).args)


def _serve_args(spec: InferenceServiceSpec) -> list[str]:
    """An embedding model's pods: `kvrelay serve`, the gateway with its engine, in the gateway role."""
    args = ["serve", "--runner", "pooling", "--model", spec.model.uri,
            "--served-model-name", spec.model.name, *spec.model.aliases, "--dtype", spec.model.dtype,
            "--host", "0.0.0.0", "--port", str(c.GATEWAY_HTTP_PORT), "--metrics-port", str(c.GATEWAY_METRICS_PORT),
            "--shutdown-delay", str(c.GATEWAY_SHUTDOWN_DELAY_S),
            "--shutdown-timeout", str(spec.gateway.shutdown_timeout_seconds)]
    if spec.model.quantization != "none":
        args += ["--quantization", spec.model.quantization]
    return args + _lora_args(spec)


def _lora_args(spec: InferenceServiceSpec) -> list[str]:
    if not spec.model.lora_adapters:
        return []
    return ["--lora-modules", *(f"{name}={uri}" for name, uri in spec.model.lora_adapters)]


def _transport_args(role: str, transport: str) -> list[str]:
    """spec.kvTransfer.transport as worker flags. Decode pods choose the data plane and offer it;
    prefill pods answer what they are offered. mooncake and rdma are the Mooncake transfer engine
    (TCP, RDMA), listening on the pod's IP in both roles."""
    if transport in ("mooncake", "rdma"):
        args = ["--kv-mooncake-host", f"$({c.POD_IP_ENV})"]  # expanded by the kubelet from env
        if role == "decode":
            args += ["--kv-transport", "mooncake", "--kv-mooncake-protocol", "rdma" if transport == "rdma" else "tcp"]
        return args
    if transport == "cuda-ipc" and role == "decode":
        return ["--kv-transport", "cuda-ipc"]
    return []


def _role_env(role: str, spec: InferenceServiceSpec, config: OperatorConfig) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": "KVRELAY_ROLE", "value": role}]
    if role in c.WORKER_ROLES:
        # Published on the load stream: the gateway pairs prefill and decode pods on one node.
        env.append({"name": c.NODE_NAME_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
        if spec.transport in ("mooncake", "rdma"):
            env.append({"name": c.POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    if role == "gateway":
        if spec.redis_secret:
            env.append({"name": "KVRELAY_REDIS_URL", "valueFrom": {"secretKeyRef": {
                "name": spec.redis_secret.name, "key": spec.redis_secret.key}}})
        elif spec.redis_url or config.default_redis_url:
            env.append({"name": "KVRELAY_REDIS_URL", "value": spec.redis_url or config.default_redis_url})
    return env + [copy.deepcopy(dict(v)) for v in spec.role(role).env]


def _probes(role: str, spec: InferenceServiceSpec) -> dict[str, Any]:
    if role == "gateway":
        # An embedding model's gateway loads the model first: a started probe waits for it, as a worker's does.
        started = {"startupProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5,
                                    "failureThreshold": 120}} if spec.model.runner == "pooling" else {}
        return {**started,
            "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5},
            "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10,
                              "failureThreshold": 6},
        }
    # gRPC workers: /ready and /health on the metrics port answer 503 while the step-loop watchdog
    # finds the engine hung (the worker also exits after its --watchdog-grace); /ready also while
    # it drains. The model loads before the port listens, so a started probe waits for it.
    return {
        "startupProbe": {"httpGet": {"path": "/health", "port": "metrics"}, "periodSeconds": 5,
                         "failureThreshold": 120},
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "metrics"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "metrics"}, "periodSeconds": 10,
                          "failureThreshold": 3},
    }


def _ports(role: str) -> list[dict[str, Any]]:
    if role == "gateway":
        return [{"name": "http", "containerPort": c.GATEWAY_HTTP_PORT, "protocol": "TCP"},
                {"name": "metrics", "containerPort": c.GATEWAY_METRICS_PORT, "protocol": "TCP"}]
    return [
        {"name": "grpc", "containerPort": c.WORKER_GRPC_PORT, "protocol": "TCP"},
        {"name": "metrics", "containerPort": c.WORKER_METRICS_PORT, "protocol": "TCP"},
    ]


def normalized_resources(resources: Mapping[str, Any]) -> dict[str, Any]:
    """Quantities as strings, the form the API server returns (`gpu: 1` reads back as "1"), so the
    drift check does not see a difference that is only a type."""
    out: dict[str, Any] = {}
    for key, value in resources.items():
        if isinstance(value, Mapping):
            out[key] = {name: str(q) if isinstance(q, int) and not isinstance(q, bool) else q
                        for name, q in value.items()}
        else:
            out[key] = copy.deepcopy(value)
    return out


def build_deployment(
    owner: Owner, role: str, spec: InferenceServiceSpec, config: OperatorConfig, replicas: int
) -> dict[str, Any]:
    rs: RoleSpec = spec.role(role)
    container: dict[str, Any] = {
        "name": role,
        "image": rs.image or config.image,
        "imagePullPolicy": config.image_pull_policy,
        "args": _role_command(owner, role, spec, config),
        "envFrom": [{"configMapRef": {"name": config_map_name(owner.name)}}],
        "env": _role_env(role, spec, config),
        "ports": _ports(role),
        **_probes(role, spec),
    }
    if rs.resources:
        container["resources"] = normalized_resources(rs.resources)
    if rs.parallelism.gpus > 1:  # one GPU per tensor/pipeline rank: all in this pod, or this node's
        res = container.setdefault("resources", {})
        for kind in ("requests", "limits"):
            res.setdefault(kind, {})["nvidia.com/gpu"] = str(rs.parallelism.gpus_per_pod)
    # SIGTERM, then the gateway's delay and the drain, then SIGKILL: the grace period covers them.
    grace = rs.shutdown_timeout_seconds + c.GRACE_MARGIN_S + (c.GATEWAY_SHUTDOWN_DELAY_S if role == "gateway" else 0)
    pod_spec: dict[str, Any] = {"containers": [container], "terminationGracePeriodSeconds": grace}
    if role == "gateway" and spec.tenants_secret:
        container["volumeMounts"] = [{"name": "tenants", "mountPath": c.TENANTS_MOUNT_DIR, "readOnly": True}]
        pod_spec["volumes"] = [{"name": "tenants", "secret": {"secretName": spec.tenants_secret.name}}]
    if role in c.WORKER_ROLES and spec.shared_memory.enabled:
        _add_shared_memory(owner, role, spec, container, pod_spec)
    if role in c.WORKER_ROLES and spec.transport == "cuda-ipc":
        # CUDA IPC handles open only in a shared IPC namespace, between pods on one node.
        pod_spec["hostIPC"] = True
        if role == "prefill":
            _prefer_decode_nodes(owner, pod_spec)
    if rs.node_selector:
        pod_spec["nodeSelector"] = dict(rs.node_selector)
    if rs.tolerations:
        pod_spec["tolerations"] = copy.deepcopy(rs.tolerations)
    template_annotations = {c.ANNOTATION_CONFIG_HASH: content_hash(settings_data(spec))}
    if role in c.WORKER_ROLES:
        template_annotations.update({"prometheus.io/scrape": "true",
                                     "prometheus.io/port": str(c.WORKER_METRICS_PORT)})
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, child_name(owner.name, role), role),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector(owner, role)},
            "template": {
                "metadata": {"labels": labels(owner, role), "annotations": template_annotations},
                "spec": pod_spec,
            },
        },
    }


def _add_shared_memory(owner: Owner, role: str, spec: InferenceServiceSpec, container: dict[str, Any],
                       pod_spec: dict[str, Any]) -> None:
    """Same-node K/V data plane: both worker roles mount the node directory (memory-backed, e.g.
    the node's /dev/shm) where each decode pod keeps its arena; prefill pods prefer nodes that run
    a decode pod of this service, so that hand-offs can skip the network. A pair on different
    nodes still works: its K/V goes inline on gRPC."""
    container["volumeMounts"] = [*container.get("volumeMounts", []),
                                 {"name": c.KV_SHM_VOLUME, "mountPath": c.KV_SHM_MOUNT_DIR}]
    pod_spec["volumes"] = [*pod_spec.get("volumes", []), {
        "name": c.KV_SHM_VOLUME, "hostPath": {"path": spec.shared_memory.host_path, "type": "Directory"}}]
    if role == "prefill":
        _prefer_decode_nodes(owner, pod_spec)


def _prefer_decode_nodes(owner: Owner, pod_spec: dict[str, Any]) -> None:
    """Prefill pods prefer nodes that run a decode pod of this service (same-node data planes)."""
    pod_spec["affinity"] = {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 100,
        "podAffinityTerm": {"labelSelector": {"matchLabels": selector(owner, "decode")},
                            "topologyKey": c.NODE_HOSTNAME_LABEL},
    }]}}


def build_service(owner: Owner, role: str) -> dict[str, Any]:
    spec: dict[str, Any] = {"selector": selector(owner, role)}
    if role == "gateway":
        spec.update(type="ClusterIP", ports=[
            {"name": "http", "port": c.GATEWAY_HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
            {"name": "metrics", "port": c.GATEWAY_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}])
    else:
        # Headless: DNS returns every ready worker pod, which the gateway balances over.
        spec.update(clusterIP="None", ports=[
            {"name": "grpc", "port": c.WORKER_GRPC_PORT, "targetPort": "grpc", "protocol": "TCP"},
            {"name": "metrics", "port": c.WORKER_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
        ])
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(owner, child_name(owner.name, role), role),
            "spec": spec}


def initial_or_live_replicas(role: str, rs: RoleSpec, live: int | None) -> int:
    """Replicas to declare: the spec's count for a fixed role; the live count (bounded) once autoscaled.

    Only prefill and decode are autoscaled; the gateway always runs `replicas` (within bounds).
    """
    if role not in c.WORKER_ROLES or not rs.autoscaled or live is None:
        return rs.initial_replicas
    return min(max(live, rs.min_replicas), rs.max_replicas)


def build_children(
    owner: Owner,
    spec: InferenceServiceSpec,
    config: OperatorConfig,
    live_replicas: Mapping[str, int | None] | None = None,
) -> list[dict[str, Any]]:
    """All children in apply order: settings first, then Services, then the workloads (a
    LeaderWorkerSet for a role whose engine spans several nodes: leaderworkerset.py)."""
    from kvrelay.operator.leaderworkerset import build_leader_worker_set, uses_lws

    check_name(owner.name)
    live_replicas = live_replicas or {}
    children = [build_config_map(owner, spec)]
    children += [build_service(owner, role) for role in spec.roles]
    children += [
        (build_leader_worker_set if uses_lws(spec, role) else build_deployment)(
            owner, role, spec, config, initial_or_live_replicas(role, spec.role(role), live_replicas.get(role)))
        for role in spec.roles
    ]
    for child in children:
        stamp_hash(child)
    return children


def hashed_content(obj: Mapping[str, Any]) -> dict[str, Any]:
    """What the spec hash covers: everything but replicas (the autoscaler's) and the hash itself."""
    body = copy.deepcopy(dict(obj))
    body.get("metadata", {}).get("annotations", {}).pop(c.ANNOTATION_SPEC_HASH, None)
    if body.get("kind") in WORKLOAD_KINDS:
        body["spec"].pop("replicas", None)
    return body


def stamp_hash(obj: dict[str, Any]) -> None:
    obj["metadata"].setdefault("annotations", {})[c.ANNOTATION_SPEC_HASH] = content_hash(hashed_content(obj))
