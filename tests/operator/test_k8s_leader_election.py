"""Operator processes that die: leader election between two replicas on a real API server (kill
-9 the leader, the standby takes over once the leader's lease has run out, never before), and a
restart in the middle of a reconcile that converges without duplicates."""

from __future__ import annotations

import datetime
import re

from kvrelay.operator import constants as c
from real_cluster import OperatorProcess, wait_for

LIFETIME = 6  # seconds a heartbeat counts (--peering-lifetime); the chart's operators use kopf's 60


def small(namespace: str, **spec) -> dict:
    return {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": "demo", "namespace": namespace},
            "spec": {"model": {"uri": "/models/m"}, "autoscaling": {"intervalSeconds": 1}, **spec}}


def handled(proc: OperatorProcess, namespace: str) -> bool:
    """Whether this operator reconciled the test's InferenceService (kopf prefixes [ns/name])."""
    return f"[{namespace}/demo] applying" in proc.text()


def resumed(proc: OperatorProcess) -> datetime.datetime | None:
    """When the operator last resumed, unless it paused again since. A replica that starts while
    a higher-priority peer is alive is paused from the start, silently (kopf logs no pause then)."""
    text = proc.text()
    at = text.rfind("Resuming operations after the pause")
    if at < 0 or text.rfind("Pausing operations in favour of") > at:
        return None
    line = text[text.rfind("\n", 0, at) + 1:]
    stamp = re.match(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]", line).group(1)
    # kopf stamps log lines in local time; a naive datetime's astimezone() reads it as such.
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").astimezone(datetime.timezone.utc)


def peers(kube, peering: str) -> dict:
    return (kube.get("clusterkopfpeering", peering, "") or {}).get("status") or {}


def test_standby_takes_over_after_the_killed_leaders_lease_and_never_before(chart, namespace, tmp_path):
    kube = chart.kube
    peering = f"le-{namespace}"
    kube.apply({"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": peering}})
    args = (f"--peering={peering}", f"--peering-lifetime={LIFETIME}")
    leader = OperatorProcess(chart.operator_kubeconfig, tmp_path / "leader.log", *args, "--priority", "20")
    standby = None
    try:
        wait_for(lambda: resumed(leader), timeout=90, what="the first replica to lead")
        standby = OperatorProcess(chart.operator_kubeconfig, tmp_path / "standby.log", *args, "--priority", "10")
        wait_for(lambda: len(peers(kube, peering)) == 2, timeout=90, what="both replicas in the peering")
        assert sorted(p["priority"] for p in peers(kube, peering).values()) == [10, 20]
        kube.apply(small(namespace))
        wait_for(lambda: kube.get("deployment", "demo-gateway", namespace), what="the leader's children")
        assert handled(leader, namespace) and not handled(standby, namespace) and not resumed(standby)

        # The leader's last heartbeat, then kill -9: it never says goodbye.
        leader.kill()
        (last,) = [p for p in peers(kube, peering).values() if p["priority"] == 20]
        lease_end = datetime.datetime.fromisoformat(last["lastseen"]) + datetime.timedelta(seconds=last["lifetime"])
        took_over = wait_for(lambda: resumed(standby), timeout=LIFETIME + 30, what="the standby to take over")
        # Never two at once: the standby resumed only once the leader's lease had run out (log
        # stamps have millisecond precision).
        assert took_over >= lease_end - datetime.timedelta(milliseconds=1), (took_over, lease_end)
        # The new leader handles the resource: a spec change reaches the Deployment.
        kube.run("patch", c.SHORT_NAME, "demo", "-n", namespace, "--type=merge",
                 "-p", '{"spec": {"decode": {"args": ["--max-num-seqs", "4"]}}}')
        wait_for(lambda: kube.get("deployment", "demo-decode", namespace)["spec"]["template"]["spec"]
                 ["containers"][0]["args"][-1] == "4", what="the new leader to roll out the change")
        assert handled(standby, namespace)
        for proc in (leader, standby):  # no write ever lost a race (409) against the other replica
            assert "APIConflictError" not in proc.text() and "status=409" not in proc.text(), proc.text()[-3000:]
        assert len(kube.items("deployments", namespace)) == 3
    finally:
        leader.kill()
        if standby is not None:
            assert standby.stop() == 0, standby.text()[-3000:]


def test_restart_in_the_middle_of_a_reconcile_converges_without_duplicates(chart, namespace, tmp_path):
    kube = chart.kube
    # A quota of one Deployment stops the first reconcile after the prefill Deployment: a
    # reconcile held half-way, for certain, where the operator is then killed.
    kube.apply({"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "one", "namespace": namespace},
                "spec": {"hard": {"count/deployments.apps": "1"}}})
    wait_for(lambda: (kube.get("resourcequota", "one", namespace).get("status") or {}).get("hard"),
             what="the quota to be counted")
    kube.apply(small(namespace))
    first = OperatorProcess(chart.operator_kubeconfig, tmp_path / "first.log", "--standalone")
    try:
        wait_for(lambda: "exceeded quota" in first.text(), timeout=90, what="the reconcile to stop at the quota")
        prefill = kube.get("deployment", "demo-prefill", namespace)
        assert prefill and kube.get("deployment", "demo-decode", namespace) is None
    finally:
        first.kill()
    kube.run("delete", "resourcequota", "one", "-n", namespace)
    second = OperatorProcess(chart.operator_kubeconfig, tmp_path / "second.log", "--standalone")
    try:
        body = wait_for(lambda: (b := kube.get(c.SHORT_NAME, "demo", namespace))
                        and (b.get("status") or {}).get("replicas", {}).get("gateway", {}).get("desired") == 1 and b,
                        timeout=90, what="the restarted operator to converge")
        assert body["status"]["observedGeneration"] == 1
        deployments = kube.items("deployments", namespace)
        assert sorted(d["metadata"]["name"] for d in deployments) == [f"demo-{r}" for r in sorted(c.ROLES)]
        # The half-built child was kept, not re-created; nothing exists twice.
        again = next(d for d in deployments if d["metadata"]["name"] == "demo-prefill")
        assert again["metadata"]["uid"] == prefill["metadata"]["uid"]
        assert len(kube.items("services", namespace)) == 3 and len(kube.items("configmaps", namespace, "-l",
                                                                              f"{c.LABEL_INSTANCE}=demo")) == 1
        wait_for(lambda: len(kube.items("replicasets", namespace)) == 3, what="one ReplicaSet per Deployment")
        assert body["metadata"]["finalizers"].count(c.FINALIZER) == 1
    finally:
        assert second.stop() == 0, second.text()[-3000:]
