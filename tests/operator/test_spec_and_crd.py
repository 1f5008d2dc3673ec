"""The CRD (single source of truth) against the operator's parsing, defaults and the example."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from kvrelay.operator import constants as c
from kvrelay.operator.spec import InvalidSpec, parse_spec
from schema_check import apply_defaults, validate

ROOT = Path(__file__).resolve().parents[2]
CRD = yaml.safe_load((ROOT / "charts/kvrelay/crds/inferenceservices.kvrelay.dev.yaml").read_text())
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]
EXAMPLE = yaml.safe_load((ROOT / "examples/inferenceservice.yaml").read_text())


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def test_crd_identity_matches_the_operator():
    assert CRD["metadata"]["name"] == f"{c.PLURAL}.{c.GROUP}"
    assert CRD["spec"]["group"] == c.GROUP and CRD["spec"]["scope"] == "Namespaced"
    assert CRD["spec"]["names"]["kind"] == c.KIND and CRD["spec"]["names"]["shortNames"] == [c.SHORT_NAME]
    assert "isvc" not in CRD["spec"]["names"]["shortNames"]  # KServe's
    assert VERSION["name"] == c.VERSION and VERSION["served"] and VERSION["storage"]
    assert VERSION["subresources"] == {"status": {}}
    columns = [col["name"] for col in VERSION["additionalPrinterColumns"]]
    assert columns == ["Ready", "Prefill", "Decode", "Gateway", "URL", "Age"]


def test_schema_requires_model_uri_and_validates_replica_bounds():
    spec = SCHEMA["properties"]["spec"]
    assert spec["required"] == ["model"] and spec["properties"]["model"]["required"] == ["uri"]
    for role in c.ROLES:
        rules = [v["rule"] for v in spec["properties"][role]["x-kubernetes-validations"]]
        # Guarded: the API server checks each rule against `default: {}` before nested defaults.
        assert "!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas" in rules
    assert spec["properties"]["model"]["properties"]["dtype"]["enum"] == ["auto", "float32", "float16", "bfloat16"]
    assert spec["properties"]["kvTransfer"]["properties"]["transport"]["enum"] == ["grpc", "mooncake", "rdma", "cuda-ipc"]


def test_operator_defaults_equal_the_crd_defaults():
    """A spec defaulted by the API server and the same spec parsed raw give the same result."""
    minimal = {"model": {"uri": "/m"}}
    defaulted = apply_defaults(minimal, SCHEMA["properties"]["spec"])
    assert defaulted["autoscaling"]["scaleDownStabilizationSeconds"] == 300  # defaults were applied
    assert parse_spec(defaulted, "x") == parse_spec(minimal, "x")
    parsed = parse_spec(minimal, "x")
    for key, sub in SCHEMA["properties"]["spec"]["properties"]["autoscaling"]["properties"].items():
        assert getattr(parsed.autoscaling, snake(key)) == sub["default"], key
    for key in ("replicas", "minReplicas", "maxReplicas"):
        default = SCHEMA["properties"]["spec"]["properties"]["decode"]["properties"][key]["default"]
        assert getattr(parsed.decode, snake(key)) == default


def test_example_is_valid_against_the_crd_and_the_operator():
    assert validate(EXAMPLE, SCHEMA) == []
    spec = parse_spec(apply_defaults(EXAMPLE, SCHEMA)["spec"], EXAMPLE["metadata"]["name"])
    assert spec.prefill.min_replicas == 0 and spec.decode.autoscaled
    assert spec.model.uri.startswith("/")


@pytest.mark.parametrize("bad, field", [
    ({"model": {"uri": "/m"}, "decode": {"minReplicas": 2, "maxReplicas": 1}}, "decode.minReplicas"),
    ({"model": {"uri": "/m", "dtype": "int4"}}, "dtype"),
    ({"model": {"uri": "/m"}, "kvTransfer": {"transport": "tcp"}}, "transport"),
    ({"model": {"uri": "/m"}, "autoscaling": {"targetPerReplica": 0}}, "targetPerReplica"),
    ({"model": {"uri": "/m", "loraAdapters": [{"name": "a=b", "uri": "/a"}]}}, "loraAdapters[0].name"),
])
def test_schema_and_operator_both_reject(bad, field):
    errors = validate({"apiVersion": "kvrelay.dev/v1alpha1", "kind": c.KIND, "metadata": {}, "spec": bad}, SCHEMA)
    if field != "decode.minReplicas":  # that one is a CEL rule, enforced by the API server
        assert any(field in e for e in errors), errors
    with pytest.raises(InvalidSpec, match=field.split(".")[-1]):
        parse_spec(bad, "x")


@pytest.mark.parametrize("bad, message", [
    ({}, "spec.model is required"),
    ({"model": {"uri": ""}}, "spec.model.uri is required"),
    ({"model": {"uri": "/m"}, "prefill": {"replicas": -1}}, "spec.prefill.replicas must be >= 0"),
    ({"model": {"uri": "/m"}, "prefill": {"replicas": "two"}}, "spec.prefill.replicas must be an integer"),
    ({"model": {"uri": "/m"}, "redis": {"url": "redis://r", "secretRef": {"name": "s"}}}, "not both"),
    ({"model": {"uri": "/m"}, "redis": {"url": "http://r"}}, "redis://"),
    ({"model": {"uri": "/m"}, "gateway": "big"}, "spec.gateway must be an object"),
    ({"model": {"uri": "/m"}, "kvTransfer": {"sharedMemory": {"size": "1.5Gi"}}}, "quantity such as 512Mi"),
    ({"model": {"uri": "/m"}, "kvTransfer": {"sharedMemory": {"size": "2Gb"}}}, "quantity such as 512Mi"),
    ({"model": {"uri": "/m"}, "kvTransfer": {"sharedMemory": {"size": 4096}}}, "at least 1Mi"),
    ({"model": {"uri": "/m"}, "kvTransfer": {"sharedMemory": {"size": "1Gi", "hostPath": "shm"}}},
     "sharedMemory.hostPath must be an absolute path"),
    ({"model": {"uri": "/m"}, "kvTransfer": {"sharedMemory": {"size": "1Gi", "prefillCache": "yes"}}},
     "sharedMemory.prefillCache must be true or false"),
    ({"model": {"uri": "/m", "loraAdapters": [{"name": "a"}]}}, "spec.model.loraAdapters[0].uri is required"),
    ({"model": {"uri": "/m"}, "gateway": {"shutdownTimeoutSeconds": -1}}, "spec.gateway.shutdownTimeoutSeconds must be >= 0"),
    ({"model": {"uri": "/m", "loraAdapters": [{"name": "x", "uri": "/a"}]}}, "is already the name of the model"),
    ({"model": {"uri": "/m", "loraAdapters": [{"name": "a", "uri": "/a"}, {"name": "a", "uri": "/b"}]}},
     "loraAdapters[1].name 'a' is already"),
    ({"model": {"uri": "/m", "loraAdapters": "a=/a"}}, "spec.model.loraAdapters must be a list"),
    ({"model": {"uri": "/m", "aliases": ["x"]}}, "spec.model.aliases[0] 'x' is already the name of the model"),
    ({"model": {"uri": "/m", "aliases": ["a b"]}}, "spec.model.aliases[0] must be a non-empty name without spaces"),
    ({"model": {"uri": "/m", "aliases": ["s"], "loraAdapters": [{"name": "s", "uri": "/a"}]}}, "of an adapter"),
])
def test_invalid_specs_name_the_field(bad, message):
    with pytest.raises(InvalidSpec, match=re.escape(message)):
        parse_spec(bad, "x")


@pytest.mark.parametrize("size, want", [("512Mi", 512 * 2**20), ("2Gi", 2 * 2**30), ("1G", 10**9),
                                        (1048576, 2**20), (0, 0)])
def test_shared_memory_sizes_are_quantities_and_defaults_match_the_crd(size, want):
    body = {"model": {"uri": "/m"}, "kvTransfer": {"sharedMemory": {"size": size}}}
    assert validate({"apiVersion": "kvrelay.dev/v1alpha1", "kind": c.KIND, "metadata": {}, "spec": body}, SCHEMA) == []
    raw = parse_spec(body, "x")
    assert raw == parse_spec(apply_defaults(body, SCHEMA["properties"]["spec"]), "x")
    assert raw.shared_memory.size_bytes == want and raw.shared_memory.host_path == "/dev/shm"
    assert raw.shared_memory.enabled == (want > 0)


def test_unknown_field_is_reported_by_the_schema():
    body = dict(EXAMPLE, spec=dict(EXAMPLE["spec"], prefil={"replicas": 1}))
    assert any("prefil: unknown field" in e for e in validate(body, SCHEMA))


def test_parallelism_is_in_the_schema_with_the_operators_defaults():
    body = {"model": {"uri": "/m"}, "decode": {"parallelism": {"tensor": 2}}, "prefill": {"parallelism": {}}}
    assert validate({"apiVersion": "kvrelay.dev/v1alpha1", "kind": c.KIND, "metadata": {}, "spec": body}, SCHEMA) == []
    raw = parse_spec(body, "x")
    assert raw == parse_spec(apply_defaults(body, SCHEMA["properties"]["spec"]), "x")
    assert (raw.decode.parallelism.tensor, raw.decode.parallelism.pipeline, raw.prefill.parallelism.gpus) == (2, 1, 1)
    bad = {"model": {"uri": "/m"}, "decode": {"parallelism": {"tensor": 0}}}
    assert validate({"apiVersion": "kvrelay.dev/v1alpha1", "kind": c.KIND, "metadata": {}, "spec": bad}, SCHEMA)
