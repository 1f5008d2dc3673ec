"""Fixtures for the operator tests: the emulated cluster and the operator running against it."""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

# The tests import the helper modules beside them (operator_harness, schema_check) under any
# pytest --import-mode; this folder can't be a package (it would be named `operator`).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvrelay.operator import constants as c
from operator_harness import ISVC, Cluster
from real_cluster import (
    CHART,
    KIT,
    RELEASE,
    RELEASE_NS,
    Kube,
    helm_path,
    start_cluster,
    stop_cluster,
    token_kubeconfig,
)


@pytest.fixture()
def kmock_options() -> dict[str, Any]:
    return {"cls": Cluster}


@pytest.fixture()
async def cluster(kmock: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Cluster]:
    kmock.resources[ISVC] = kmock.ResourceInfo(
        kind=c.KIND, singular="inferenceservice", namespaced=True, shortnames={c.SHORT_NAME},
        verbs={"get", "list", "watch", "create", "patch", "update", "delete"}, subresources={"status"})
    kmock.resources["v1/namespaces"] = kmock.ResourceInfo(kind="Namespace", namespaced=False,
                                                           verbs={"get", "list", "watch"})
    kmock.resources["v1/events"] = kmock.ResourceInfo(kind="Event", namespaced=True, verbs={"create", "list"})
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url).rstrip("/")}}],
        "users": [{"name": "kmock", "user": {}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": "default"}}],
    }))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.setenv("KVRELAY_IMAGE", "kvrelay:test")
    yield kmock


@pytest.fixture()
async def operator_runner(cluster: Cluster) -> AsyncIterator[Callable[..., Any]]:
    """Start kopf with our handlers in a thread; stops with the test."""
    from kopf.testing import KopfRunner

    runners: list[KopfRunner] = []

    def start(*extra: str) -> KopfRunner:
        runner = KopfRunner(["run", "--standalone", "-A", "-m", "kvrelay.operator.handlers", *extra], timeout=30)
        runner.__enter__()
        runners.append(runner)
        return runner

    yield start
    for runner in runners:  # stopping joins the thread: keep the emulator's loop running meanwhile
        await asyncio.to_thread(runner.__exit__, None, None, None)



# --- A real Kubernetes control plane (../shared/k8s), one per test session. ---

@dataclass
class RealCluster:
    workdir: Path
    env: dict[str, str]
    kube: Kube  # as the admin
    operator_kubeconfig: Path | None = None  # as the chart's ServiceAccount, once `chart` ran

    @property
    def audit_log(self) -> Path:
        return self.workdir / "audit.log"


@pytest.fixture(scope="session")
def k8s(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealCluster]:
    if not (KIT / "start.sh").exists():
        if os.environ.get("KVRELAY_REQUIRE_K8S") == "1":  # set by .ci/run: CI must not skip these
            pytest.fail(f"KVRELAY_REQUIRE_K8S=1 but the Kubernetes kit is missing at {KIT}")
        pytest.skip(f"real Kubernetes kit not found at {KIT} (../shared/k8s, or set K8S_KIT)")
    workdir = tmp_path_factory.mktemp("k8s")
    try:
        env = start_cluster(workdir)
    except RuntimeError as e:
        pytest.fail(str(e))
    try:
        yield RealCluster(workdir, env, Kube(env["KUBECONFIG"]))
    finally:
        stop_cluster(workdir)


@pytest.fixture(scope="session")
def chart(k8s: RealCluster) -> RealCluster:
    """`helm install` of the chart (CRDs, RBAC, ServiceAccount, operator Deployment, peering)."""
    out = subprocess.run([helm_path(), "install", RELEASE, str(CHART), "-n", RELEASE_NS, "--create-namespace",
                          "--kubeconfig", k8s.env["KUBECONFIG"]], check=False, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stdout + out.stderr
    k8s.operator_kubeconfig = token_kubeconfig(k8s.kube, k8s.env["K8S_CA_FILE"], k8s.env["K8S_API_URL"],
                                               k8s.workdir / "operator.kubeconfig")
    return k8s


@pytest.fixture()
def namespace(k8s: RealCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test; deleted (without waiting) afterwards."""
    name = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower().removeprefix("test_"))[:40].strip("-")
    name = f"{name}-{secrets.token_hex(2)}"
    k8s.kube.run("create", "namespace", name)
    yield name
    k8s.kube.run("delete", "namespace", name, "--wait=false", check=False)
