"""Helpers for the tests against a real Kubernetes control plane (../shared/k8s: etcd,
kube-apiserver, kube-controller-manager; no kubelet, so pods never run).

The cluster starts once per test session (conftest.py `k8s`), with an audit log of every request
the operator's ServiceAccount makes: the RBAC test reads it to show each granted verb is used.
The chart is installed once (`chart`); the operator runs here as a process that authenticates
with a token of the chart's ServiceAccount, so the API server's RBAC judges each of its calls.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
KIT = Path(os.environ.get("K8S_KIT", ROOT.parent / "shared" / "k8s"))
CHART = ROOT / "charts" / "kvrelay"
RELEASE = "kvrelay"  # the chart's full name is then "kvrelay": ServiceAccount, ClusterRole, peering
RELEASE_NS = "kvrelay-system"
OPERATOR_USER = f"system:serviceaccount:{RELEASE_NS}:{RELEASE}"

AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1", "kind": "Policy", "omitStages": ["RequestReceived"],
    "rules": [{"level": "Metadata", "users": [OPERATOR_USER]}, {"level": "None"}],
}


def kubectl_path() -> str:
    found = shutil.which("kubectl") or (str(ROOT / ".venv/bin/kubectl") if (ROOT / ".venv/bin/kubectl").exists()
                                        else None)
    if found is None:
        raise RuntimeError("kubectl not found: scripts/ci.d/40-kubectl.sh installs it")
    return found


def helm_path() -> str:
    found = shutil.which("helm") or (str(ROOT / ".venv/bin/helm") if (ROOT / ".venv/bin/helm").exists() else None)
    if found is None:
        raise RuntimeError("helm not found: scripts/ci.d/30-helm.sh installs it")
    return found


def start_cluster(workdir: Path) -> dict[str, str]:
    """start.sh with the audit log on; returns its env file (KUBECONFIG, K8S_API_URL, ...)."""
    policy = workdir / "audit-policy.yaml"
    policy.write_text(yaml.safe_dump(AUDIT_POLICY))
    env = dict(os.environ, APISERVER_EXTRA=(
        f"--audit-policy-file={policy} --audit-log-path={workdir / 'audit.log'} "
        # Real clusters (OpenShift among them) enable it: setting blockOwnerDeletion on a child
        # needs `update` on the owner's finalizers, which the chart's ClusterRole grants.
        "--enable-admission-plugins=OwnerReferencesPermissionEnforcement"))
    out = subprocess.run(["bash", str(KIT / "start.sh"), str(workdir)], check=False, capture_output=True, text=True,
                         timeout=180, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"{KIT}/start.sh failed:\n{out.stderr[-4000:]}")
    return dict(line.split("=", 1) for line in (workdir / "env").read_text().split())


def stop_cluster(workdir: Path) -> None:
    subprocess.run(["bash", str(KIT / "stop.sh"), str(workdir)], check=False, capture_output=True, timeout=60)


def wait_for(check: Callable[[], Any], timeout: float = 60.0, interval: float = 0.2, what: str = "") -> Any:
    """Poll `check` until it returns something truthy; fail with the last value seen."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = check()
            if last:
                return last
        except (KeyError, TypeError, IndexError, subprocess.CalledProcessError) as e:
            last = e
        if time.monotonic() > deadline:
            raise AssertionError(f"{what or 'condition'} not met within {timeout}s; last: {last!r}")
        time.sleep(interval)


@dataclass
class Kube:
    """kubectl against one cluster, as the admin (the test's own hand) unless told otherwise."""

    kubeconfig: str

    def run(self, *args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        out = subprocess.run([kubectl_path(), "--kubeconfig", self.kubeconfig, *args], check=False, input=stdin,
                             capture_output=True, text=True, timeout=60)
        if check and out.returncode != 0:
            raise subprocess.CalledProcessError(out.returncode, args, out.stdout, out.stderr)
        return out

    def apply(self, obj: dict[str, Any] | list[dict[str, Any]], *args: str, check: bool = True
              ) -> subprocess.CompletedProcess:
        docs = obj if isinstance(obj, list) else [obj]
        return self.run("apply", "-f", "-", *args, stdin=yaml.safe_dump_all(docs), check=check)

    def get(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
        out = self.run("get", kind, name, "-n", namespace, "-o", "json", check=False)
        if out.returncode != 0:
            if "NotFound" in out.stderr:
                return None
            raise subprocess.CalledProcessError(out.returncode, ["get", kind, name], out.stdout, out.stderr)
        return json.loads(out.stdout)

    def items(self, kind: str, namespace: str, *args: str) -> list[dict[str, Any]]:
        return json.loads(self.run("get", kind, "-n", namespace, "-o", "json", *args).stdout)["items"]

    def events(self, namespace: str, involved: str) -> list[dict[str, Any]]:
        return self.items("events", namespace, "--field-selector", f"involvedObject.name={involved}")


def token_kubeconfig(kube: Kube, ca_file: str, server: str, path: Path) -> Path:
    """A kubeconfig that authenticates as the chart's ServiceAccount (a TokenRequest token)."""
    token = kube.run("create", "token", RELEASE, "-n", RELEASE_NS, "--duration", "2h").stdout.strip()
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "operator",
        "clusters": [{"name": "k8s", "cluster": {"server": server, "certificate-authority": ca_file}}],
        "users": [{"name": RELEASE, "user": {"token": token}}],
        "contexts": [{"name": "operator", "context": {"cluster": "k8s", "user": RELEASE}}],
    }))
    return path


class OperatorProcess:
    """`kvrelay operator` in its own process (so kill -9 is real), logging to a file."""

    def __init__(self, kubeconfig: Path, log: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.log = log
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", KUBECONFIG=str(kubeconfig), KVRELAY_IMAGE="kvrelay:test",
                        **(env or {}))
        self.proc = subprocess.Popen([sys.executable, "-m", "kvrelay.cli", "operator", "--liveness", "", *args],
                                     stdout=log.open("w"), stderr=subprocess.STDOUT, env=full_env)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        """kill -9: no clean-up, no goodbye to the peering object."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.returncode


def audited_calls(audit_log: Path, user: str = OPERATOR_USER) -> dict[str, set[tuple[str, str, str]]]:
    """(apiGroup, resource[/subresource], verb) of every request `user` made, by RBAC decision
    ("allow" or "forbid")."""
    calls: dict[str, set[tuple[str, str, str]]] = {"allow": set(), "forbid": set()}
    for line in audit_log.read_text().splitlines():
        event = json.loads(line)
        ref = event.get("objectRef") or {}
        decision = event.get("annotations", {}).get("authorization.k8s.io/decision")
        if event["user"]["username"] != user or not ref.get("resource") or decision not in calls:
            continue
        resource = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        calls[decision].add((ref.get("apiGroup", ""), resource, event["verb"]))
    return calls
