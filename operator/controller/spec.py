"""The InferenceService spec as plain dataclasses, with the CRD's defaults and its validation.

The API server applies the CRD's defaults and schema; the operator applies them again so it never
depends on them (older CRD installed, objects written with validation off) and never crashes on
bad input: anything wrong raises InvalidSpec with a message that names the field.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DTYPES = ("auto", "float32", "float16", "bfloat16")
QUANTIZATIONS = ("none", "int8")  # what the engine implements
# generate: prefill and decode workers behind the gateway; pooling: an embedding model, served by
# `kvrelay serve --runner pooling` in the gateway's pods (an embedding has no decode phase to split off).
RUNNERS = ("generate", "pooling")
# grpc: K/V inline on the control stream; mooncake: the Mooncake transfer engine over TCP (any node);
# rdma: the same over RDMA; cuda-ipc: GPU to GPU between pods on one node (kvrelay.kvtransfer).
TRANSPORTS = ("grpc", "mooncake", "rdma", "cuda-ipc")
# Kubernetes quantity suffixes, for sizes given as strings ("2Gi", "512M").
_QUANTITY_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
                   "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
MIN_SHM_BYTES = 2**20
METRICS = ("queueDepth",)


class InvalidSpec(ValueError):
    """The resource's spec cannot be reconciled; the message says which field and why."""


@dataclass(frozen=True)
class ParallelismSpec:
    """A role's engine split over GPUs: --tensor-parallel-size x --pipeline-parallel-size worker
    processes, one GPU each; beyond gpusPerNode, over several nodes (a LeaderWorkerSet group)."""

    tensor: int = 1
    pipeline: int = 1
    gpus_per_node: int | None = None  # None: every rank in one pod

    @property
    def gpus(self) -> int:
        return self.tensor * self.pipeline

    @property
    def nodes(self) -> int:
        """Pods (nodes) per engine: 1, or tensor x pipeline / gpusPerNode (a LeaderWorkerSet's size)."""
        if self.gpus_per_node is None or self.gpus <= self.gpus_per_node:
            return 1
        return self.gpus // self.gpus_per_node

    @property
    def gpus_per_pod(self) -> int:
        return self.gpus // self.nodes


@dataclass(frozen=True)
class RoleSpec:
    replicas: int = 1
    min_replicas: int = 1
    max_replicas: int = 1
    resources: dict[str, Any] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    image: str | None = None
    args: list[str] = field(default_factory=list)
    env: list[dict[str, Any]] = field(default_factory=list)
    parallelism: ParallelismSpec = ParallelismSpec()
    shutdown_timeout_seconds: int = 25  # --shutdown-timeout; the pod's grace period covers it

    @property
    def autoscaled(self) -> bool:
        return self.max_replicas > self.min_replicas

    @property
    def initial_replicas(self) -> int:
        return min(max(self.replicas, self.min_replicas), self.max_replicas)


@dataclass(frozen=True)
class ModelSpec:
    uri: str
    name: str
    dtype: str = "auto"
    quantization: str = "none"
    # LoRA adapters served beside the model: (name clients send, folder inside the pod), in order.
    lora_adapters: tuple[tuple[str, str], ...] = ()
    aliases: tuple[str, ...] = ()  # more names the gateway answers to (as `name`)
    runner: str = "generate"


@dataclass(frozen=True)
class AutoscalingSpec:
    metric: str = "queueDepth"
    target_per_replica: float = 4.0
    kv_cache_usage_target: float = 0.85
    tolerance: float = 0.1
    scale_up_stabilization_seconds: int = 0
    scale_down_stabilization_seconds: int = 300
    interval_seconds: int = 15
    max_step_replicas: int = 4


@dataclass(frozen=True)
class SharedMemorySpec:
    """Same-node K/V data plane: each decode pod keeps an arena of size_bytes (0: off) in the
    node directory host_path, which prefill pods on that node mount too. prefill_cache: prefill
    pods keep their KV cache there as well, and decode pods copy from it directly."""

    size_bytes: int = 0
    host_path: str = "/dev/shm"
    prefill_cache: bool = False

    @property
    def enabled(self) -> bool:
        return self.size_bytes > 0


@dataclass(frozen=True)
class SecretRef:
    name: str
    key: str


@dataclass(frozen=True)
class InferenceServiceSpec:
    model: ModelSpec
    prefill: RoleSpec
    decode: RoleSpec
    gateway: RoleSpec
    autoscaling: AutoscalingSpec
    transport: str = "grpc"
    shared_memory: SharedMemorySpec = SharedMemorySpec()
    tenants_secret: SecretRef | None = None
    redis_url: str | None = None
    redis_secret: SecretRef | None = None

    def role(self, name: str) -> RoleSpec:
        return {"prefill": self.prefill, "decode": self.decode, "gateway": self.gateway}[name]

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles this service runs: an embedding model only the gateway's (which runs `kvrelay serve`)."""
        return ("gateway",) if self.model.runner == "pooling" else ("prefill", "decode", "gateway")


def _obj(value: Any, path: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidSpec(f"{path} must be an object, got {type(value).__name__}")
    return value


def _int(src: Mapping[str, Any], key: str, path: str, default: int, minimum: int = 0) -> int:
    value = src.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSpec(f"{path}.{key} must be an integer, got {value!r}")
    if value < minimum:
        raise InvalidSpec(f"{path}.{key} must be >= {minimum}, got {value}")
    return value


def _num(src: Mapping[str, Any], key: str, path: str, default: float, low: float, high: float | None,
         low_inclusive: bool = True) -> float:
    value = src.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidSpec(f"{path}.{key} must be a number, got {value!r}")
    too_low = value < low if low_inclusive else value <= low
    if too_low or (high is not None and value > high):
        bound = f"{'>=' if low_inclusive else '>'} {low}" + (f" and <= {high}" if high is not None else "")
        raise InvalidSpec(f"{path}.{key} must be {bound}, got {value}")
    return float(value)


def _enum(src: Mapping[str, Any], key: str, path: str, choices: tuple[str, ...]) -> str:
    value = src.get(key, choices[0])
    if value not in choices:
        raise InvalidSpec(f"{path}.{key} must be one of {', '.join(choices)}; got {value!r}")
    return value


def _list(src: Mapping[str, Any], key: str, path: str) -> list[Any]:
    value = src.get(key) or []
    if not isinstance(value, list):
        raise InvalidSpec(f"{path}.{key} must be a list, got {type(value).__name__}")
    return list(value)


def _parallelism(value: Any, path: str, resources: Mapping[str, Any]) -> ParallelismSpec:
    src = _obj(value, path)
    if not src:
        return ParallelismSpec()
    if path.startswith("spec.gateway"):
        raise InvalidSpec(f"{path}: only the prefill and decode roles run a model")
    gpn = src.get("gpusPerNode")
    par = ParallelismSpec(tensor=_int(src, "tensor", path, 1, minimum=1),
                          pipeline=_int(src, "pipeline", path, 1, minimum=1),
                          gpus_per_node=None if gpn is None else _int(src, "gpusPerNode", path, 1, minimum=1))
    if par.nodes > 1 and par.gpus % par.gpus_per_node:
        raise InvalidSpec(f"{path}: tensor x pipeline = {par.gpus} GPUs exceeds gpusPerNode {par.gpus_per_node} "
                          f"and is not a multiple of it: the ranks must split evenly over the nodes")
    for kind in ("requests", "limits"):
        asked = _obj(resources.get(kind), f"{path}.resources.{kind}").get("nvidia.com/gpu")
        if par.gpus > 1 and asked is not None and str(asked) != str(par.gpus_per_pod):
            raise InvalidSpec(f"{path}: tensor x pipeline = {par.gpus} GPUs ({par.gpus_per_pod} per pod), but "
                              f"resources.{kind} asks for nvidia.com/gpu {asked}; drop it (the operator sets it) "
                              f"or make them equal")
    return par


def _role(value: Any, path: str) -> RoleSpec:
    src = _obj(value, path)
    role = RoleSpec(
        replicas=_int(src, "replicas", path, 1),
        min_replicas=_int(src, "minReplicas", path, 1),
        max_replicas=_int(src, "maxReplicas", path, 1),
        resources=dict(_obj(src.get("resources"), f"{path}.resources")),
        node_selector={str(k): str(v) for k, v in _obj(src.get("nodeSelector"), f"{path}.nodeSelector").items()},
        tolerations=_list(src, "tolerations", path),
        image=src.get("image") or None,
        args=[str(a) for a in _list(src, "args", path)],
        env=_list(src, "env", path),
        parallelism=_parallelism(src.get("parallelism"), f"{path}.parallelism",
                                 _obj(src.get("resources"), f"{path}.resources")),
        shutdown_timeout_seconds=_int(src, "shutdownTimeoutSeconds", path, 25),
    )
    if role.min_replicas > role.max_replicas:
        raise InvalidSpec(
            f"{path}.minReplicas ({role.min_replicas}) must be <= {path}.maxReplicas ({role.max_replicas})"
        )
    for i, var in enumerate(role.env):
        if not isinstance(var, Mapping) or not var.get("name"):
            raise InvalidSpec(f"{path}.env[{i}] must be an object with a name")
    return role


def _bytes(value: Any, path: str) -> int:
    """An integer byte count or a Kubernetes quantity string ("2Gi", "512M")."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = re.fullmatch(r"(\d+)([a-zA-Z]*)", value.strip()) if isinstance(value, str) else None
    if not m or m.group(2) not in _QUANTITY_UNITS:
        raise InvalidSpec(f"{path} must be a byte count or a quantity such as 512Mi or 2Gi, got {value!r}")
    return int(m.group(1)) * _QUANTITY_UNITS[m.group(2)]


def _kv_transfer(value: Any) -> tuple[str, SharedMemorySpec]:
    path = "spec.kvTransfer"
    src = _obj(value, path)
    transport = _enum(src, "transport", path, TRANSPORTS)
    shm_src = _obj(src.get("sharedMemory"), f"{path}.sharedMemory")
    if not shm_src:
        return transport, SharedMemorySpec()
    size = _bytes(shm_src.get("size", 0), f"{path}.sharedMemory.size")
    if 0 < size < MIN_SHM_BYTES:
        raise InvalidSpec(f"{path}.sharedMemory.size must be 0 (off) or at least 1Mi, got {size} bytes")
    host_path = shm_src.get("hostPath", "/dev/shm")
    if not isinstance(host_path, str) or not host_path.startswith("/"):
        raise InvalidSpec(f"{path}.sharedMemory.hostPath must be an absolute path on the node, got {host_path!r}")
    prefill_cache = shm_src.get("prefillCache", False)
    if not isinstance(prefill_cache, bool):
        raise InvalidSpec(f"{path}.sharedMemory.prefillCache must be true or false, got {prefill_cache!r}")
    return transport, SharedMemorySpec(size_bytes=size, host_path=host_path, prefill_cache=prefill_cache)


def _secret_ref(value: Any, path: str, default_key: str) -> SecretRef | None:
    if value is None:
        return None
    src = _obj(value, path)
    if not src.get("name"):
        raise InvalidSpec(f"{path}.name is required")
    return SecretRef(name=str(src["name"]), key=str(src.get("key") or default_key))


def _lora_adapters(model: Mapping[str, Any], model_name: str) -> tuple[tuple[str, str], ...]:
    """spec.model.loraAdapters: [{name, uri}], each name a model of its own to clients."""
    out: list[tuple[str, str]] = []
    for i, item in enumerate(_list(model, "loraAdapters", "spec.model")):
        path = f"spec.model.loraAdapters[{i}]"
        item = _obj(item, path)
        name, uri = item.get("name"), item.get("uri")
        if not isinstance(name, str) or not re.fullmatch(r"[^=\s]+", name):
            raise InvalidSpec(f"{path}.name must be a non-empty name without spaces or '=', got {name!r}")
        if not isinstance(uri, str) or not uri.strip():
            raise InvalidSpec(f"{path}.uri is required: the adapter's folder inside the pod")
        if name == model_name or name in dict(out):
            raise InvalidSpec(f"{path}.name {name!r} is already the name of the model or of another adapter")
        out.append((name, uri))
    return tuple(out)


def _aliases(model: Mapping[str, Any], model_name: str) -> tuple[str, ...]:
    """spec.model.aliases: more names clients may send, answered as the model's name."""
    out: list[str] = []
    adapters = {a.get("name") for a in _list(model, "loraAdapters", "spec.model") if isinstance(a, Mapping)}
    for i, alias in enumerate(_list(model, "aliases", "spec.model")):
        path = f"spec.model.aliases[{i}]"
        if not isinstance(alias, str) or not re.fullmatch(r"\S+", alias):
            raise InvalidSpec(f"{path} must be a non-empty name without spaces, got {alias!r}")
        if alias == model_name or alias in out or alias in adapters:
            raise InvalidSpec(f"{path} {alias!r} is already the name of the model, of another alias or of an adapter")
        out.append(alias)
    return tuple(out)


def parse_spec(spec: Mapping[str, Any] | None, resource_name: str) -> InferenceServiceSpec:
    """Parse and validate a resource's spec; raise InvalidSpec naming the first bad field."""
    spec = _obj(spec, "spec")
    if "model" not in spec:
        raise InvalidSpec("spec.model is required (spec.model.uri: the model folder inside the pod)")
    model_src = _obj(spec["model"], "spec.model")
    uri = model_src.get("uri")
    if not isinstance(uri, str) or not uri.strip():
        raise InvalidSpec("spec.model.uri is required: the model folder inside the pod, e.g. /models/llama")
    model = ModelSpec(
        uri=uri,
        name=str(model_src.get("name") or resource_name),
        dtype=_enum(model_src, "dtype", "spec.model", DTYPES),
        quantization=_enum(model_src, "quantization", "spec.model", QUANTIZATIONS),
        lora_adapters=_lora_adapters(model_src, str(model_src.get("name") or resource_name)),
        aliases=_aliases(model_src, str(model_src.get("name") or resource_name)),
        runner=_enum(model_src, "runner", "spec.model", RUNNERS),
    )
    a = _obj(spec.get("autoscaling"), "spec.autoscaling")
    p = "spec.autoscaling"
    autoscaling = AutoscalingSpec(
        metric=_enum(a, "metric", p, METRICS),
        target_per_replica=_num(a, "targetPerReplica", p, 4.0, 0.0, None, low_inclusive=False),
        kv_cache_usage_target=_num(a, "kvCacheUsageTarget", p, 0.85, 0.0, 1.0, low_inclusive=False),
        tolerance=_num(a, "tolerance", p, 0.1, 0.0, 1.0),
        scale_up_stabilization_seconds=_int(a, "scaleUpStabilizationSeconds", p, 0),
        scale_down_stabilization_seconds=_int(a, "scaleDownStabilizationSeconds", p, 300),
        interval_seconds=_int(a, "intervalSeconds", p, 15, minimum=1),
        max_step_replicas=_int(a, "maxStepReplicas", p, 4, minimum=1),
    )
    redis = _obj(spec.get("redis"), "spec.redis")
    redis_url = redis.get("url") or None
    redis_secret = _secret_ref(redis.get("secretRef"), "spec.redis.secretRef", "url")
    if redis_url and redis_secret:
        raise InvalidSpec("spec.redis: set either url or secretRef, not both")
    if redis_url is not None and not re.match(r"^rediss?://", str(redis_url)):
        raise InvalidSpec(f"spec.redis.url must start with redis:// or rediss://, got {redis_url!r}")
    tenants = _obj(spec.get("tenants"), "spec.tenants")
    transport, shared_memory = _kv_transfer(spec.get("kvTransfer"))
    prefill, decode = _role(spec.get("prefill"), "spec.prefill"), _role(spec.get("decode"), "spec.decode")
    if model.runner == "pooling":
        for name, role in (("prefill", prefill), ("decode", decode)):
            if role != RoleSpec():  # the CRD's filled-in defaults parse to RoleSpec() too
                raise InvalidSpec(f"spec.{name}: an embedding model (spec.model.runner: pooling) runs no {name} "
                                  "workers: the gateway's pods serve it, so size spec.gateway instead")
        if transport != "grpc" or shared_memory.enabled:
            raise InvalidSpec("spec.kvTransfer: an embedding model (spec.model.runner: pooling) hands no K/V over")
    return InferenceServiceSpec(
        model=model,
        prefill=prefill,
        decode=decode,
        gateway=_role(spec.get("gateway"), "spec.gateway"),
        autoscaling=autoscaling,
        transport=transport,
        shared_memory=shared_memory,
        tenants_secret=_secret_ref(tenants.get("secretRef"), "spec.tenants.secretRef", "tenants.yaml"),
        redis_url=redis_url,
        redis_secret=redis_secret,
    )
