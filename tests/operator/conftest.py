"""Fixtures for the operator tests: the emulated cluster and the operator running against it."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

# The tests import the helper modules beside them (operator_harness, schema_check) under any
# pytest --import-mode; this folder can't be a package (it would be named `operator`).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kvrelay.operator import constants as c
from operator_harness import ISVC, Cluster


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

