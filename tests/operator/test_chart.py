"""The Helm chart: lints strictly, renders least-privilege RBAC, the operator and optional Redis."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from kvrelay.operator import constants as c

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "kvrelay"
INSTALLER = ROOT / "scripts" / "ci.d" / "30-helm.sh"


def run(*cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=False, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def helm() -> str:
    """helm from PATH or .venv/bin; installed by scripts/ci.d/30-helm.sh when missing."""
    found = shutil.which("helm") or (str(ROOT / ".venv/bin/helm") if (ROOT / ".venv/bin/helm").exists() else None)
    if found is None:
        result = run("bash", str(INSTALLER), timeout=300)
        found = str(ROOT / ".venv/bin/helm") if (ROOT / ".venv/bin/helm").exists() else None
        if found is None:
            pytest.fail(f"helm is required for the chart tests and {INSTALLER} could not install it:\n"
                        f"{result.stdout}\n{result.stderr}")
    return found


def render(helm: str, *args: str, namespace: str = "ops") -> list[dict]:
    out = run(helm, "template", "t", str(CHART), "-n", namespace, *args)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def operator_container(docs: list[dict]) -> dict:
    (deployment,) = find(docs, "Deployment", "t-kvrelay-operator")
    return deployment["spec"]["template"]["spec"]["containers"][0]


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_helm_lint_strict_passes(helm):
    out = run(helm, "lint", "--strict", str(CHART))
    assert out.returncode == 0, out.stdout + out.stderr


def test_cluster_role_is_exactly_what_the_operator_uses(helm):
    docs = render(helm)
    (role,) = find(docs, "ClusterRole")
    assert role["rules"] == c.RBAC_RULES
    (binding,) = find(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    (account,) = find(docs, "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "ops"}]
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        assert "delete" not in rule["verbs"]  # deletion is the garbage collector's job


def test_default_install_runs_leader_elected_operator_and_bundled_redis(helm):
    docs = render(helm)
    container = operator_container(docs)
    (deployment,) = find(docs, "Deployment", "t-kvrelay-operator")
    assert deployment["spec"]["replicas"] == 2
    assert container["args"][0] == "operator" and "--peering=t-kvrelay" in container["args"]
    assert "--peering-lifetime=60" in container["args"]
    assert find(docs, "ClusterKopfPeering", "t-kvrelay")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "t-kvrelay"
    env = env_of(container)
    assert env["KVRELAY_IMAGE"] == "ghcr.io/kvrelay/kvrelay:0.1.0"
    assert env["KVRELAY_DEFAULT_REDIS_URL"] == "redis://t-kvrelay-redis.ops.svc.cluster.local:6379/0"
    (redis_service,) = find(docs, "Service", "t-kvrelay-redis")
    assert redis_service["spec"]["ports"][0]["port"] == 6379
    assert find(docs, "Deployment", "t-kvrelay-redis")


def test_external_redis_url_turns_the_bundled_redis_off(helm):
    docs = render(helm, "--set", "redis.externalUrl=redis://cache.shared:6379/2")
    assert not find(docs, "Deployment", "t-kvrelay-redis") and not find(docs, "Service", "t-kvrelay-redis")
    assert env_of(operator_container(docs))["KVRELAY_DEFAULT_REDIS_URL"] == "redis://cache.shared:6379/2"
    no_redis = render(helm, "--set", "redis.enabled=false")
    assert "KVRELAY_DEFAULT_REDIS_URL" not in env_of(operator_container(no_redis))


def test_single_replica_without_leader_election(helm):
    docs = render(helm, "--set", "operator.replicas=1", "--set", "operator.leaderElection.enabled=false")
    assert "--standalone" in operator_container(docs)["args"]
    assert not find(docs, "ClusterKopfPeering")
    (role,) = find(docs, "ClusterRole")
    assert all("kopf.dev" not in rule["apiGroups"] for rule in role["rules"])
    out = run(helm, "template", "t", str(CHART), "--set", "operator.replicas=3",
              "--set", "operator.leaderElection.enabled=false")
    assert out.returncode != 0 and "leaderElection" in out.stderr


def test_crds_ship_with_the_chart(helm):
    docs = render(helm, "--include-crds")
    crds = {d["metadata"]["name"]: d for d in find(docs, "CustomResourceDefinition")}
    assert set(crds) == {"inferenceservices.kvrelay.dev", "clusterkopfpeerings.kopf.dev"}
    source = yaml.safe_load((CHART / "crds" / "inferenceservices.kvrelay.dev.yaml").read_text())
    assert crds["inferenceservices.kvrelay.dev"] == source


def test_workload_image_override_reaches_the_operator(helm):
    docs = render(helm, "--set", "workloadImage=registry.local/kvrelay:gpu", "--set", "image.tag=9.9")
    container = operator_container(docs)
    assert container["image"] == "ghcr.io/kvrelay/kvrelay:9.9"
    assert env_of(container)["KVRELAY_IMAGE"] == "registry.local/kvrelay:gpu"
