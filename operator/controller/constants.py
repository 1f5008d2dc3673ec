"""Names the operator shares with the cluster, the chart and the other kvrelay roles.

Everything another component must agree on lives here: API group, labels, ports, the Prometheus
metric names the autoscaler reads and where it scrapes them.
"""

from __future__ import annotations

GROUP = "kvrelay.dev"
VERSION = "v1alpha1"
PLURAL = "inferenceservices"
KIND = "InferenceService"
# `kubectl get kvisvc`. Not `isvc`: KServe's InferenceService owns that short name, and clusters
# often run both (kubectl would then pick one of the two kinds for `isvc`).
SHORT_NAME = "kvisvc"
API_VERSION = f"{GROUP}/{VERSION}"

FIELD_MANAGER = "kvrelay-operator"  # server-side apply of the children
SCALER_FIELD_MANAGER = "kvrelay-autoscaler"  # owns only spec.replicas of autoscaled Deployments
FINALIZER = "kvrelay.dev/finalizer"
PEERING_NAME = "kvrelay-operator"  # ClusterKopfPeering used for leader election

# Labels and annotations on every child.
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
ANNOTATION_SPEC_HASH = "kvrelay.dev/spec-hash"  # hash of what the operator applied last
ANNOTATION_CONFIG_HASH = "kvrelay.dev/config-hash"  # on pod templates: settings changes roll pods

ROLES = ("prefill", "decode", "gateway")
WORKER_ROLES = ("prefill", "decode")

# Ports of the one kvrelay image's role subcommands.
WORKER_GRPC_PORT = 50051
WORKER_METRICS_PORT = 9090
GATEWAY_HTTP_PORT = 8000
GATEWAY_METRICS_PORT = 9090  # the gateway's /metrics, apart from its API port
# On SIGTERM the gateway serves this long before draining, while Services and ingresses take the pod
# out (kvrelay.gateway.drain); the pod's grace period adds it and a margin to the shutdown timeout.
GATEWAY_SHUTDOWN_DELAY_S = 5
GRACE_MARGIN_S = 5

DEFAULT_IMAGE = "ghcr.io/kvrelay/kvrelay:0.1.0"  # overridden by KVRELAY_IMAGE (set by the chart)
TENANTS_MOUNT_DIR = "/etc/kvrelay/tenants"
POD_IP_ENV = "KVRELAY_POD_IP"  # the pod's IP (downward API): where its Mooncake transfer engine listens
KV_SHM_MOUNT_DIR = "/kv-shm"  # where prefill and decode pods mount spec.kvTransfer.sharedMemory.hostPath
KV_SHM_VOLUME = "kv-shm"
NODE_HOSTNAME_LABEL = "kubernetes.io/hostname"
NODE_NAME_ENV = "KVRELAY_NODE_NAME"  # worker env from the pod's spec.nodeName (kvrelay.kvtransfer.worker_base)

# Engines over several nodes (spec.<role>.parallelism beyond gpusPerNode): a LeaderWorkerSet
# (https://lws.sigs.k8s.io) per role, when its CRD is installed. LWS sets LWS_LEADER_ADDRESS and
# LWS_WORKER_INDEX in every pod of a group; the leader pod is node 0 (the engine), the others
# run `kvrelay parallel-worker` (kvrelay.engine.parallel.multinode).
LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_API_VERSION = f"{LWS_GROUP}/v1"
LWS_KIND = "LeaderWorkerSet"
LWS_PLURAL = "leaderworkersets"
LWS_CRD = f"{LWS_PLURAL}.{LWS_GROUP}"
LWS_LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
LWS_WORKER_INDEX_ENV = "LWS_WORKER_INDEX"
PARALLEL_DIST_PORT = 29500  # torch.distributed rendezvous on the leader pod; its control listener is + 1
PARALLEL_TOKEN_ENV = "KVRELAY_PARALLEL_TOKEN"  # the nodes' shared secret, from Secret <name>-parallel-token
PARALLEL_TOKEN_KEY = "token"

# Prometheus metrics the autoscaler reads (see services/gateway and the workers' /metrics).
METRIC_GATEWAY_QUEUE_DEPTH = "kvrelay:gateway_queue_depth"  # labels: model, role="prefill"|"decode"
METRIC_WORKER_WAITING = "kvrelay:num_requests_waiting"
METRIC_WORKER_RUNNING = "kvrelay:num_requests_running"
METRIC_WORKER_KV_USAGE = "kvrelay:kv_cache_usage_perc"  # 0-1

# Scrape targets, as URL templates over {name} (the InferenceService), {namespace} and {port}.
# Each host is resolved to all of its addresses, so a headless Service yields every worker pod.
# Overridable per environment variable (tests point them at local HTTP servers).
SCRAPE_URL_TEMPLATES = {
    "gateway": "http://{name}-gateway.{namespace}.svc.cluster.local:{port}/metrics",
    "prefill": "http://{name}-prefill.{namespace}.svc.cluster.local:{port}/metrics",
    "decode": "http://{name}-decode.{namespace}.svc.cluster.local:{port}/metrics",
}
SCRAPE_ENV = {role: f"KVRELAY_SCRAPE_{role.upper()}_URL" for role in ROLES}
SCRAPE_TIMEOUT_SECONDS = 2.0

# The API calls the operator makes, as RBAC rules. The chart's ClusterRole must equal these
# (tests/operator/test_chart.py) and the end-to-end tests check every request against them; on a
# real API server, tests/operator/test_k8s_operator.py shows each verb is used (audit log).
RBAC_RULES: list[dict[str, list[str]]] = [
    {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["list", "watch", "patch"]},
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["patch"]},
    {"apiGroups": [GROUP], "resources": [f"{PLURAL}/finalizers"], "verbs": ["update"]},
    {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "create", "patch"]},
    {"apiGroups": [LWS_GROUP], "resources": [LWS_PLURAL], "verbs": ["get", "create", "patch"]},
    {"apiGroups": [""], "resources": ["services", "configmaps"], "verbs": ["get", "create", "patch"]},
    {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},  # the nodes' token, created once
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]},
    {"apiGroups": ["kopf.dev"], "resources": ["clusterkopfpeerings"], "verbs": ["get", "list", "watch", "patch"]},
    # kopf's resource observer: notices CRDs appearing and going (without it, kopf retries for a minute).
    {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"], "verbs": ["list", "watch"]},
]
