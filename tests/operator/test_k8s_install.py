"""The chart and the CRD on a real API server: what `helm install` creates, a server-side dry run
of the rendered manifests, the CRD's CEL rule and defaults, and the operator's start-up check."""

from __future__ import annotations

import subprocess

from kvrelay.operator import constants as c
from real_cluster import CHART, RELEASE, RELEASE_NS, OperatorProcess, helm_path, wait_for


def isvc(name: str, namespace: str, **spec) -> dict:
    return {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": name, "namespace": namespace},
            "spec": {"model": {"uri": "/models/m"}, **spec}}


def test_helm_install_creates_crds_rbac_service_account_and_operator(chart):
    kube = chart.kube
    for crd in ("inferenceservices.kvrelay.dev", "clusterkopfpeerings.kopf.dev"):
        established = kube.run("get", "crd", crd, "-o",
                               "jsonpath={.status.conditions[?(@.type=='Established')].status}").stdout
        assert established == "True", crd
    role = kube.get("clusterrole", f"{RELEASE}-operator", "")
    assert role["rules"] == c.RBAC_RULES
    binding = kube.get("clusterrolebinding", f"{RELEASE}-operator", "")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE, "namespace": RELEASE_NS}]
    assert kube.get("serviceaccount", RELEASE, RELEASE_NS)
    deployment = kube.get("deployment", f"{RELEASE}-operator", RELEASE_NS)
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == RELEASE
    assert f"--peering={RELEASE}" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert kube.get("clusterkopfpeering", RELEASE, "")
    # The API server itself says what the ServiceAccount may do.
    who = f"--as=system:serviceaccount:{RELEASE_NS}:{RELEASE}"
    assert kube.run("auth", "can-i", "patch", "deployments", "-n", "any", who).stdout.strip() == "yes"
    assert kube.run("auth", "can-i", "delete", "deployments", "-n", "any", who, check=False).stdout.strip() == "no"


def test_rendered_chart_passes_a_server_side_dry_run(chart):
    rendered = subprocess.run([helm_path(), "template", "other", str(CHART), "-n", "dry-run", "--include-crds",
                               "--set", "redis.enabled=false"],
                              check=True, capture_output=True, text=True, timeout=60).stdout
    assert "kind: ClusterRole" in rendered
    out = chart.kube.run("apply", "--dry-run=server", "-n", "default", "-f", "-", stdin=rendered.replace(
        "namespace: dry-run", "namespace: default"))
    assert "(server dry run)" in out.stdout and "customresourcedefinition" in out.stdout


def test_cel_rule_refuses_min_above_max_and_defaults_fill_the_rest(chart, namespace):
    kube = chart.kube
    refused = kube.apply(isvc("bad", namespace, decode={"minReplicas": 3, "maxReplicas": 1}), check=False)
    assert refused.returncode != 0
    assert "spec.decode: Invalid value" in refused.stderr
    assert "minReplicas must be less than or equal to maxReplicas" in refused.stderr
    # minReplicas alone: the default maxReplicas (1) is filled in first, so the rule still applies.
    alone = kube.apply(isvc("bad", namespace, prefill={"minReplicas": 2}), check=False)
    assert alone.returncode != 0 and "spec.prefill: Invalid value" in alone.stderr
    kube.apply(isvc("good", namespace, decode={"maxReplicas": 4}))
    spec = kube.get(c.SHORT_NAME, "good", namespace)["spec"]
    assert spec["decode"] == {"replicas": 1, "minReplicas": 1, "maxReplicas": 4, "shutdownTimeoutSeconds": 25}
    assert spec["prefill"] == spec["gateway"] == {"replicas": 1, "minReplicas": 1, "maxReplicas": 1,
                                                  "shutdownTimeoutSeconds": 25}
    assert spec["autoscaling"]["scaleDownStabilizationSeconds"] == 300
    # The short name resolves, and it is not KServe's.
    columns = kube.run("api-resources", "--api-group", c.GROUP, "--no-headers").stdout.split()
    assert c.SHORT_NAME in columns and "isvc" not in columns


def test_operator_without_its_peering_object_exits_naming_it(chart, tmp_path):
    proc = OperatorProcess(chart.operator_kubeconfig, tmp_path / "op.log", "--peering", "not-there")
    try:
        wait_for(lambda: proc.proc.poll() is not None, timeout=90, what="the operator to exit")
    finally:
        proc.stop()
    assert proc.proc.returncode != 0
    log = proc.text()
    assert "ClusterKopfPeering 'not-there' not found" in log and "--standalone" in log
    assert "kubectl create -f -" in log
