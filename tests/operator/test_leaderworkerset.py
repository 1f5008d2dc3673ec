"""Engines over several nodes: a role whose tensor x pipeline exceeds gpusPerNode becomes a
LeaderWorkerSet (leader = the engine, node 0; workers = `kvrelay parallel-worker`), and the pods'
commands parse with the real CLI once the kubelet has substituted LWS's environment."""

from __future__ import annotations

import re

import pytest
from kvrelay.engine.parallel.multinode import TOKEN_ENV
from kvrelay.operator import constants as c
from kvrelay.operator.builders import Owner, build_children
from kvrelay.operator.config import OperatorConfig
from kvrelay.operator.leaderworkerset import build_token_secret
from kvrelay.operator.spec import InvalidSpec, parse_spec
from test_cli_contract import role_parser

OWNER = Owner(name="demo", namespace="team-a", uid="1234")
SPEC = {"model": {"uri": "/models/m"}, "decode": {"replicas": 2, "maxReplicas": 2, "parallelism": {
    "tensor": 8, "pipeline": 2, "gpusPerNode": 8}}, "prefill": {"parallelism": {"tensor": 4, "gpusPerNode": 8}}}


def built(spec: dict = SPEC) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o
            for o in build_children(OWNER, parse_spec(spec, OWNER.name), OperatorConfig(image="kvrelay:1"))}


def kubelet(args: list[str], env: dict[str, str]) -> list[str]:
    """$(VAR) substituted as the kubelet does."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


def test_a_role_beyond_one_node_is_a_leader_worker_set_of_node_groups():
    objs = built()
    assert ("Deployment", "demo-decode") not in objs and ("Deployment", "demo-prefill") in objs
    lws = objs[c.LWS_KIND, "demo-decode"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["metadata"]["ownerReferences"][0]["uid"] == "1234" and lws["metadata"]["annotations"][
        c.ANNOTATION_SPEC_HASH]
    assert lws["spec"]["replicas"] == 2  # engines (groups), each over `size` nodes
    tpl = lws["spec"]["leaderWorkerTemplate"]
    assert tpl["size"] == 2 and tpl["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = tpl["leaderTemplate"], tpl["workerTemplate"]
    for template in (leader, worker):
        (container,) = template["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"  # gpusPerNode, not 16
        assert {"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": "demo-parallel-token", "key": "token"}}
                } in container["env"]
    # The role's Service selects the leaders (the engines) only.
    selector = objs["Service", "demo-decode"]["spec"]["selector"]
    assert all(leader["metadata"]["labels"][k] == v for k, v in selector.items())
    assert any(worker["metadata"]["labels"].get(k) != v for k, v in selector.items())
    assert "readinessProbe" in leader["spec"]["containers"][0]
    assert "readinessProbe" not in worker["spec"]["containers"][0] and "ports" not in worker["spec"]["containers"][0]


def test_leader_and_worker_commands_parse_with_lws_environment():
    tpl = built()[c.LWS_KIND, "demo-decode"]["spec"]["leaderWorkerTemplate"]
    env = {"LWS_LEADER_ADDRESS": "demo-decode-0.demo-decode.team-a", "LWS_WORKER_INDEX": "1"}
    leader_args = kubelet(tpl["leaderTemplate"]["spec"]["containers"][0]["args"], env)
    assert leader_args[0] == "decode"
    parsed = role_parser("decode").parse_args(leader_args[1:])
    assert (parsed.tensor_parallel_size, parsed.pipeline_parallel_size, parsed.nnodes, parsed.node_rank) == (8, 2, 2, 0)
    assert parsed.dist_init_addr == "demo-decode-0.demo-decode.team-a:29500"
    worker_args = kubelet(tpl["workerTemplate"]["spec"]["containers"][0]["args"], env)
    assert worker_args[0] == "parallel-worker"
    parsed = role_parser("parallel-worker").parse_args(worker_args[1:])
    assert (parsed.nnodes, parsed.node_rank, parsed.dist_init_addr) == (2, 1, "demo-decode-0.demo-decode.team-a:29500")


def test_token_secret_is_random_unless_given_and_owned():
    a, b = build_token_secret(OWNER), build_token_secret(OWNER)
    assert a["stringData"]["token"] != b["stringData"]["token"] and len(a["stringData"]["token"]) >= 32
    assert a["metadata"]["name"] == "demo-parallel-token" and a["metadata"]["ownerReferences"][0]["uid"] == "1234"


@pytest.mark.parametrize("par, message", [
    ({"tensor": 8, "pipeline": 2, "gpusPerNode": 6}, "16 GPUs exceeds gpusPerNode 6 and is not a multiple"),
])
def test_uneven_split_over_nodes_is_invalid(par, message):
    with pytest.raises(InvalidSpec, match=message):
        parse_spec({"model": {"uri": "/m"}, "decode": {"parallelism": par}}, "x")
    with pytest.raises(InvalidSpec, match=r"\(8 per pod\), but resources.limits asks for nvidia.com/gpu 16"):
        parse_spec({"model": {"uri": "/m"}, "decode": {"parallelism": {"tensor": 16, "gpusPerNode": 8},
                                                        "resources": {"limits": {"nvidia.com/gpu": 16}}}}, "x")


def test_long_names_that_lws_cannot_hold_are_invalid():
    with pytest.raises(InvalidSpec, match="LeaderWorkerSet names fit 48"):
        build_children(Owner("x" * 45, "ns", "u"), parse_spec(SPEC, "x" * 45), OperatorConfig())
