"""Children of an InferenceService as built for server-side apply."""

from __future__ import annotations

import pytest
from kvrelay.operator import constants as c
from kvrelay.operator.builders import Owner, build_children, check_name
from kvrelay.operator.config import OperatorConfig
from kvrelay.operator.spec import InvalidSpec, parse_spec

OWNER = Owner(name="demo", namespace="team-a", uid="1234")
CONFIG = OperatorConfig(image="kvrelay:1", default_redis_url="redis://kvrelay-redis.ops:6379/0")


def children(spec: dict, live: dict | None = None, config: OperatorConfig = CONFIG) -> dict[tuple[str, str], dict]:
    built = build_children(OWNER, parse_spec(spec, OWNER.name), config, live)
    return {(obj["kind"], obj["metadata"]["name"]): obj for obj in built}


def pod(objs, role):
    return objs["Deployment", f"demo-{role}"]["spec"]["template"]["spec"]


def test_one_configmap_three_services_three_deployments_all_owned():
    objs = children({"model": {"uri": "/m"}})
    assert sorted(objs) == sorted([("ConfigMap", "demo-config")] + [(k, f"demo-{r}") for r in c.ROLES
                                                                     for k in ("Service", "Deployment")])
    for obj in objs.values():
        assert obj["metadata"]["namespace"] == "team-a"
        assert obj["metadata"]["ownerReferences"] == [{"apiVersion": "kvrelay.dev/v1alpha1", "kind": "InferenceService",
                                                        "name": "demo", "uid": "1234", "controller": True,
                                                        "blockOwnerDeletion": True}]
        assert obj["metadata"]["annotations"][c.ANNOTATION_SPEC_HASH]


def test_worker_and_gateway_commands_follow_the_cli_contract():
    objs = children({"model": {"uri": "/models/llama"}, "decode": {"args": ["--max-batch", "8"]}})
    decode = pod(objs, "decode")["containers"][0]
    assert decode["args"] == ["decode", "--model", "/models/llama", "--port", "50051", "--metrics-port", "9090",
                              "--served-model-name", "demo", "--dtype", "auto", "--shutdown-timeout", "25",
                              "--max-batch", "8"]
    assert decode["image"] == "kvrelay:1"
    gateway = pod(objs, "gateway")["containers"][0]
    assert gateway["args"][:9] == ["gateway", "--prefill", "dns:///demo-prefill.team-a.svc.cluster.local:50051",
                                   "--decode", "dns:///demo-decode.team-a.svc.cluster.local:50051",
                                   "--host", "0.0.0.0", "--port", "8000"]
    # No redis in the spec: the chart's bundled Redis.
    assert gateway["args"][-2:] == ["--redis-url", "$(KVRELAY_REDIS_URL)"]
    assert {"name": "KVRELAY_REDIS_URL", "value": "redis://kvrelay-redis.ops:6379/0"} in gateway["env"]
    assert objs["Service", "demo-prefill"]["spec"]["clusterIP"] == "None"
    assert objs["Service", "demo-gateway"]["spec"]["ports"][0]["port"] == 8000
    # Metrics on their own port: the API port's /metrics hides tenants and needs a key.
    assert gateway["args"][9:11] == ["--metrics-port", "9090"]
    assert objs["Service", "demo-gateway"]["spec"]["ports"][1] == {
        "name": "metrics", "port": 9090, "targetPort": "metrics", "protocol": "TCP"}


def test_model_settings_become_worker_flags():
    objs = children({"model": {"uri": "/m", "name": "llama-3", "dtype": "bfloat16", "quantization": "int8"}})
    for role in ("prefill", "decode"):
        args = pod(objs, role)["containers"][0]["args"]
        assert args[args.index("--served-model-name") + 1] == "llama-3"
        assert args[args.index("--dtype") + 1] == "bfloat16"
        assert args[args.index("--quantization") + 1] == "int8"
    assert objs["ConfigMap", "demo-config"]["data"]["KVRELAY_MODEL_NAME"] == "llama-3"


def test_the_grace_period_covers_the_gateways_delay_and_each_roles_shutdown_timeout():
    def flag(args: list[str], name: str) -> str:
        return args[args.index(name) + 1]

    objs = children({"model": {"uri": "/m"}})
    gateway = pod(objs, "gateway")
    assert flag(gateway["containers"][0]["args"], "--shutdown-delay") == "5"
    assert flag(gateway["containers"][0]["args"], "--shutdown-timeout") == "25"
    assert gateway["terminationGracePeriodSeconds"] == 5 + 25 + 5
    for role in ("prefill", "decode"):
        assert flag(pod(objs, role)["containers"][0]["args"], "--shutdown-timeout") == "25"
        assert pod(objs, role)["terminationGracePeriodSeconds"] == 30  # Kubernetes' default
    long = children({"model": {"uri": "/m"}, "decode": {"shutdownTimeoutSeconds": 600}})
    assert flag(pod(long, "decode")["containers"][0]["args"], "--shutdown-timeout") == "600"
    assert pod(long, "decode")["terminationGracePeriodSeconds"] == 605
    assert pod(long, "prefill")["terminationGracePeriodSeconds"] == 30


def test_redis_secret_and_tenants_secret_are_wired_into_the_gateway():
    objs = children({"model": {"uri": "/m"}, "redis": {"secretRef": {"name": "r"}},
                     "tenants": {"secretRef": {"name": "t", "key": "tenants.json"}}})
    spec = pod(objs, "gateway")
    container = spec["containers"][0]
    assert {"name": "KVRELAY_REDIS_URL", "valueFrom": {"secretKeyRef": {"name": "r", "key": "url"}}} in container["env"]
    assert container["args"][container["args"].index("--tenants") + 1] == "/etc/kvrelay/tenants/tenants.json"
    assert spec["volumes"] == [{"name": "tenants", "secret": {"secretName": "t"}}]


def test_no_redis_anywhere_means_no_redis_flag():
    objs = children({"model": {"uri": "/m"}}, config=OperatorConfig())
    assert "--redis-url" not in pod(objs, "gateway")["containers"][0]["args"]


def test_role_placement_and_resources_are_passed_through():
    objs = children({"model": {"uri": "/m"}, "decode": {
        "resources": {"limits": {"nvidia.com/gpu": 1}}, "nodeSelector": {"gpu": "h100"},
        "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "env": [{"name": "X", "value": "1"}], "image": "custom:2"}})
    spec = pod(objs, "decode")
    assert spec["nodeSelector"] == {"gpu": "h100"} and spec["tolerations"][0]["key"] == "gpu"
    assert spec["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": "1"}}  # as the server returns it
    assert spec["containers"][0]["image"] == "custom:2"
    assert spec["containers"][0]["env"][-1] == {"name": "X", "value": "1"}


def test_shared_memory_plane_mounts_the_node_directory_and_pairs_prefill_with_decode_nodes():
    objs = children({"model": {"uri": "/m"}, "kvTransfer": {"sharedMemory": {"size": "2Gi", "hostPath": "/mnt/kv"}},
                     "prefill": {"nodeSelector": {"pool": "a"}}})
    decode, prefill = pod(objs, "decode"), pod(objs, "prefill")
    args = decode["containers"][0]["args"]
    assert args[args.index("--kv-shm-bytes") + 1] == str(2 * 2**30)
    assert args[args.index("--kv-shm-dir") + 1] == "/kv-shm"
    assert "--kv-shm-bytes" not in prefill["containers"][0]["args"]  # prefill only opens what decode offers
    assert "--kv-shared-cache" not in prefill["containers"][0]["args"]  # prefillCache is off by default
    for spec in (decode, prefill):
        assert spec["volumes"] == [{"name": "kv-shm", "hostPath": {"path": "/mnt/kv", "type": "Directory"}}]
        assert spec["containers"][0]["volumeMounts"] == [{"name": "kv-shm", "mountPath": "/kv-shm"}]
    (term,) = prefill["affinity"]["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"] == {"labelSelector": {"matchLabels": {c.LABEL_INSTANCE: "demo",
                                                                          c.LABEL_COMPONENT: "decode"}},
                                       "topologyKey": "kubernetes.io/hostname"}
    assert prefill["nodeSelector"] == {"pool": "a"} and "affinity" not in decode
    for spec in (decode, prefill):  # workers publish their node; the gateway pairs on it
        assert {"name": "KVRELAY_NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in (
            spec["containers"][0]["env"])
    # Off by default, and with size 0: no volume, no flag, no affinity.
    for kv in ({}, {"sharedMemory": {"size": 0}}):
        plain = children({"model": {"uri": "/m"}, "kvTransfer": kv})
        for role in ("prefill", "decode"):
            assert "volumes" not in pod(plain, role) and "affinity" not in pod(plain, role)
            assert "--kv-shm-bytes" not in pod(plain, role)["containers"][0]["args"]


@pytest.mark.parametrize("transport,protocol", [("mooncake", "tcp"), ("rdma", "rdma")])
def test_mooncake_transports_listen_on_the_pod_ip_and_decode_pods_choose_the_protocol(transport, protocol):
    objs = children({"model": {"uri": "/m"}, "kvTransfer": {"transport": transport}})
    for role in ("prefill", "decode"):
        container = pod(objs, role)["containers"][0]
        args = container["args"]
        assert args[args.index("--kv-mooncake-host") + 1] == "$(KVRELAY_POD_IP)"
        assert {"name": "KVRELAY_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]
    decode_args = pod(objs, "decode")["containers"][0]["args"]
    assert decode_args[decode_args.index("--kv-transport") + 1] == "mooncake"
    assert decode_args[decode_args.index("--kv-mooncake-protocol") + 1] == protocol
    assert "--kv-transport" not in pod(objs, "prefill")["containers"][0]["args"]  # prefill answers offers
    assert "hostIPC" not in pod(objs, "decode")


def test_cuda_ipc_shares_the_ipc_namespace_and_pairs_prefill_with_decode_nodes():
    objs = children({"model": {"uri": "/m"}, "kvTransfer": {"transport": "cuda-ipc"}})
    decode, prefill = pod(objs, "decode"), pod(objs, "prefill")
    args = decode["containers"][0]["args"]
    assert args[args.index("--kv-transport") + 1] == "cuda-ipc"
    assert decode["hostIPC"] is True and prefill["hostIPC"] is True
    assert "podAffinity" in prefill["affinity"] and "affinity" not in decode
    plain = children({"model": {"uri": "/m"}})
    for role in ("prefill", "decode"):
        assert "hostIPC" not in pod(plain, role)
        assert not {"--kv-transport", "--kv-mooncake-host"} & set(pod(plain, role)["containers"][0]["args"])


def test_prefill_cache_puts_the_prefill_pods_kv_cache_in_the_node_directory():
    objs = children({"model": {"uri": "/m"},
                     "kvTransfer": {"sharedMemory": {"size": "1Gi", "prefillCache": True}}})
    args = pod(objs, "prefill")["containers"][0]["args"]
    assert "--kv-shared-cache" in args and args[args.index("--kv-shm-dir") + 1] == "/kv-shm"
    assert "--kv-shared-cache" not in pod(objs, "decode")["containers"][0]["args"]
    # Without the plane there is no directory to share: the flag needs a size.
    off = children({"model": {"uri": "/m"}, "kvTransfer": {"sharedMemory": {"size": 0, "prefillCache": True}}})
    assert "--kv-shared-cache" not in pod(off, "prefill")["containers"][0]["args"]


def test_replicas_fixed_roles_follow_spec_autoscaled_roles_keep_live_count_within_bounds():
    spec = {"model": {"uri": "/m"}, "prefill": {"replicas": 2, "minReplicas": 0, "maxReplicas": 5},
            "gateway": {"replicas": 3, "minReplicas": 1, "maxReplicas": 3}}
    fresh = children(spec)
    assert fresh["Deployment", "demo-prefill"]["spec"]["replicas"] == 2
    live = children(spec, {"prefill": 4, "gateway": 1, "decode": 7})
    assert live["Deployment", "demo-prefill"]["spec"]["replicas"] == 4  # the autoscaler's value
    assert live["Deployment", "demo-gateway"]["spec"]["replicas"] == 3  # gateway: always the spec
    assert live["Deployment", "demo-decode"]["spec"]["replicas"] == 1  # decode fixed at 1..1
    assert children(spec, {"prefill": 9})["Deployment", "demo-prefill"]["spec"]["replicas"] == 5


def test_hash_ignores_replicas_but_tracks_content_and_settings_roll_pods():
    spec = {"model": {"uri": "/m"}, "prefill": {"minReplicas": 0, "maxReplicas": 5}}
    a = children(spec, {"prefill": 1})["Deployment", "demo-prefill"]
    b = children(spec, {"prefill": 4})["Deployment", "demo-prefill"]
    assert a["metadata"]["annotations"] == b["metadata"]["annotations"]
    c2 = children(dict(spec, model={"uri": "/m", "dtype": "bfloat16"}), {"prefill": 1})["Deployment", "demo-prefill"]
    assert c2["metadata"]["annotations"] != a["metadata"]["annotations"]
    hash_key = c.ANNOTATION_CONFIG_HASH
    assert (c2["spec"]["template"]["metadata"]["annotations"][hash_key]
            != a["spec"]["template"]["metadata"]["annotations"][hash_key])


def test_names_too_long_for_child_services_are_invalid():
    check_name("a" * 55)
    with pytest.raises(InvalidSpec, match="at most 55"):
        check_name("a" * 56)


def test_every_role_has_readiness_and_liveness_probes_on_its_health_endpoints():
    objs = children({"model": {"uri": "/m"}})
    for role in ("prefill", "decode"):
        container = pod(objs, role)["containers"][0]
        ports = {p["name"] for p in container["ports"]}
        for probe, path in (("readinessProbe", "/ready"), ("livenessProbe", "/health"), ("startupProbe", "/health")):
            assert container[probe]["httpGet"] == {"path": path, "port": "metrics"} and "metrics" in ports
    gateway = pod(objs, "gateway")["containers"][0]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health"


def test_parallelism_sets_the_worker_flags_and_one_gpu_per_rank():
    objs = children({"model": {"uri": "/m"}, "decode": {"parallelism": {"tensor": 2, "pipeline": 2}},
                     "prefill": {"parallelism": {"tensor": 2}, "resources": {"limits": {"cpu": "4"}}}})
    decode = pod(objs, "decode")["containers"][0]
    assert decode["args"][-4:] == ["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"]
    assert decode["resources"] == {"requests": {"nvidia.com/gpu": "4"}, "limits": {"nvidia.com/gpu": "4"}}
    prefill = pod(objs, "prefill")["containers"][0]
    assert "--pipeline-parallel-size" not in prefill["args"] and prefill["args"][-2:] == ["--tensor-parallel-size", "2"]
    assert prefill["resources"]["limits"] == {"cpu": "4", "nvidia.com/gpu": "2"}
    assert "resources" not in pod(objs, "gateway")["containers"][0]


@pytest.mark.parametrize("role, par, message", [
    ("decode", {"tensor": 4, "pipeline": 2, "gpusPerNode": 3}, "8 GPUs exceeds gpusPerNode 3 and is not a multiple"),
    ("decode", {"tensor": 0}, "spec.decode.parallelism.tensor must be >= 1"),
    ("gateway", {"tensor": 2}, "only the prefill and decode roles run a model"),
])
def test_parallelism_that_cannot_be_served_is_invalid(role, par, message):
    with pytest.raises(InvalidSpec, match=message):
        parse_spec({"model": {"uri": "/m"}, role: {"parallelism": par}}, "x")
    with pytest.raises(InvalidSpec, match="asks for nvidia.com/gpu 1"):
        parse_spec({"model": {"uri": "/m"}, "decode": {"parallelism": {"tensor": 2},
                                                        "resources": {"limits": {"nvidia.com/gpu": 1}}}}, "x")


def test_an_embedding_model_runs_serve_in_the_gateway_pods_and_no_workers():
    objs = children({"model": {"uri": "/m", "runner": "pooling"},
                     "gateway": {"replicas": 2, "maxReplicas": 2, "resources": {"limits": {"nvidia.com/gpu": 1}}}})
    assert sorted(objs) == [("ConfigMap", "demo-config"), ("Deployment", "demo-gateway"), ("Service", "demo-gateway")]
    spec = pod(objs, "gateway")
    container = spec["containers"][0]
    assert container["args"][:3] == ["serve", "--runner", "pooling"]
    assert "--prefill" not in container["args"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}  # the model loads first
    assert objs["Deployment", "demo-gateway"]["spec"]["replicas"] == 2
    plain = pod(children({"model": {"uri": "/m"}}), "gateway")["containers"][0]
    assert "startupProbe" not in plain and plain["args"][0] == "gateway"


@pytest.mark.parametrize(("extra", "message"), [
    ({"decode": {"replicas": 3}}, "spec.decode: an embedding model"),
    ({"prefill": {"args": ["--x"]}}, "spec.prefill: an embedding model"),
    ({"kvTransfer": {"transport": "mooncake"}}, "hands no K/V over"),
    ({"model": {"uri": "/m", "runner": "embed"}}, "spec.model.runner must be one of generate, pooling"),
])
def test_an_embedding_model_refuses_worker_settings(extra, message):
    spec = {"model": {"uri": "/m", "runner": "pooling"}} | extra
    with pytest.raises(InvalidSpec, match=message):
        parse_spec(spec, "demo")
    # The CRD's filled-in defaults for the worker roles are not settings.
    defaults = {"replicas": 1, "minReplicas": 1, "maxReplicas": 1, "shutdownTimeoutSeconds": 25}
    parse_spec({"model": {"uri": "/m", "runner": "pooling"}, "prefill": defaults, "decode": defaults}, "demo")
