"""The commands the operator puts in pods parse with the real `kvrelay` role subcommands."""

from __future__ import annotations

import argparse
import importlib

import pytest
from kvrelay.operator.builders import Owner, build_children
from kvrelay.operator.config import OperatorConfig
from kvrelay.operator.spec import parse_spec

from kvrelay import cli

SPEC = {"model": {"uri": "/models/m", "name": "m", "dtype": "float32", "quantization": "int8", "aliases": ["m2", "m3"],
                  "loraAdapters": [{"name": "sql", "uri": "/adapters/sql"}, {"name": "chat", "uri": "/adapters/chat"}]},
        "tenants": {"secretRef": {"name": "t"}}, "redis": {"url": "redis://r:6379/0"},
        "kvTransfer": {"sharedMemory": {"size": "1Gi"}}}


def role_parser(role: str) -> argparse.ArgumentParser:
    module_name = {"prefill": "kvrelay.prefill.cli", "decode": "kvrelay.decode.cli"}.get(role)
    if role in cli.COMMANDS:
        module_name = cli.COMMANDS[role][0]
    if module_name is None:
        pytest.skip(f"`kvrelay {role}` is not available yet")
    parser = argparse.ArgumentParser(prog=f"kvrelay {role}")
    importlib.import_module(module_name).add_arguments(parser)
    return parser


@pytest.mark.parametrize("transport", ["grpc", "rdma"])
@pytest.mark.parametrize("role", ["prefill", "decode", "gateway"])
def test_pod_arguments_parse(role, transport):
    spec = SPEC | {"kvTransfer": SPEC["kvTransfer"] | {"transport": transport}}
    children = build_children(Owner("demo", "ns", "uid"), parse_spec(spec, "demo"), OperatorConfig())
    (deployment,) = [d for d in children if d["kind"] == "Deployment" and d["metadata"]["name"] == f"demo-{role}"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == role
    parsed = role_parser(role).parse_args(args[1:])
    assert parsed.lora_modules == ["sql=/adapters/sql", "chat=/adapters/chat"]  # every role knows the adapters
    assert parsed.shutdown_timeout == 25
    if role == "gateway":
        assert parsed.host == "0.0.0.0" and parsed.port == 8000
        assert parsed.prefill == "dns:///demo-prefill.ns.svc.cluster.local:50051"
        assert parsed.redis_url == "$(KVRELAY_REDIS_URL)"  # the kubelet substitutes it from env
        assert parsed.model == "/models/m"  # the gateway tokenizes with the served model's tokenizer
        assert parsed.shutdown_delay == 5
        assert parsed.served_model_name == ["m", "m2", "m3"]
    else:
        assert parsed.model == "/models/m" and parsed.port == 50051 and parsed.metrics_port == 9090
        assert parsed.dtype == "float32" and parsed.quantization == "int8"
        if role == "decode":
            assert parsed.kv_shm_bytes == 2**30 and parsed.kv_shm_dir == "/kv-shm"
        if transport == "rdma":
            assert parsed.kv_mooncake_host == "$(KVRELAY_POD_IP)"
            if role == "decode":
                assert parsed.kv_transport == "mooncake" and parsed.kv_mooncake_protocol == "rdma"


def test_worker_node_name_comes_from_the_environment_the_operator_sets(monkeypatch):
    from kvrelay.kvtransfer.worker_base import NODE_NAME_ENV
    from kvrelay.operator import constants as c

    assert c.NODE_NAME_ENV == NODE_NAME_ENV
    monkeypatch.setenv(NODE_NAME_ENV, "node-7")
    for role in ("prefill", "decode"):
        assert role_parser(role).parse_args(["--port", "1"]).node_name == "node-7"



def test_an_embedding_models_serve_arguments_parse():
    spec = {k: v for k, v in SPEC.items() if k != "kvTransfer"}
    spec["model"] = SPEC["model"] | {"runner": "pooling"}
    children = build_children(Owner("demo", "ns", "uid"), parse_spec(spec, "demo"), OperatorConfig())
    (deployment,) = [d for d in children if d["kind"] == "Deployment"]
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "serve"
    parsed = role_parser("serve").parse_args(args[1:])
    assert parsed.runner == "pooling" and parsed.model == "/models/m"
    assert parsed.served_model_name == ["m", "m2", "m3"] and parsed.lora_modules == ["sql=/adapters/sql", "chat=/adapters/chat"]
    assert parsed.dtype == "float32" and parsed.quantization == "int8"
    assert parsed.host == "0.0.0.0" and parsed.port == 8000 and parsed.metrics_port == 9090
    assert parsed.redis_url == "$(KVRELAY_REDIS_URL)" and parsed.tenants.endswith("tenants.yaml")
    assert parsed.shutdown_delay == 5 and parsed.shutdown_timeout == 25
