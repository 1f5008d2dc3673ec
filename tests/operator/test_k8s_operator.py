"""`kvrelay operator` on a real API server, as the chart's ServiceAccount: children with owner
references, status, printer columns, Events, rollout, drift repair, invalid specs, the autoscaler
on real Deployments fed by real /metrics endpoints, deletion through the garbage collector, and
(last) that the chart's ClusterRole grants nothing the operator does not use.

One operator process serves the whole module (leader election through the chart's peering
object, as installed); each test works in its own namespace.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml
from kvrelay.operator import constants as c
from real_cluster import RELEASE, ROOT, OperatorProcess, audited_calls, wait_for

INSTANCE = c.LABEL_INSTANCE
LWS_CRD = c.LWS_CRD


class MetricsEndpoints:
    """Prometheus text at /{namespace}/{name}/{role}/metrics, one per InferenceService and role;
    404 for anything not set, which the operator reads as "metrics unavailable"."""

    def __init__(self) -> None:
        self.gauges: dict[tuple[str, str, str], dict[str, float]] = {}
        self.scrapes = 0
        endpoints = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                parts = self.path.strip("/").split("/")
                gauges = endpoints.gauges.get(tuple(parts[:3])) if len(parts) == 4 else None
                if gauges is None:
                    self.send_error(404)
                    return
                endpoints.scrapes += 1
                body = "".join(f"# TYPE {k.split('{')[0]} gauge\n{k} {v}\n" for k, v in dict(gauges).items())
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *_: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def templates(self) -> dict[str, str]:
        port = self.server.server_address[1]
        return {c.SCRAPE_ENV[role]: f"http://127.0.0.1:{port}/{{namespace}}/{{name}}/{role}/metrics"
                for role in c.ROLES}

    def set_load(self, namespace: str, name: str, prefill_queue: float = 0, decode_queue: float = 0,
                 prefill_waiting: float = 0, decode_waiting: float = 0) -> None:
        self.gauges[(namespace, name, "gateway")] = {
            f'{c.METRIC_GATEWAY_QUEUE_DEPTH}{{model="{name}",role="prefill"}}': prefill_queue,
            f'{c.METRIC_GATEWAY_QUEUE_DEPTH}{{model="{name}",role="decode"}}': decode_queue}
        self.gauges[(namespace, name, "prefill")] = {c.METRIC_WORKER_WAITING: prefill_waiting,
                                                     c.METRIC_WORKER_RUNNING: 0}
        self.gauges[(namespace, name, "decode")] = {c.METRIC_WORKER_WAITING: decode_waiting,
                                                    c.METRIC_WORKER_RUNNING: 0, c.METRIC_WORKER_KV_USAGE: 0.0}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def metrics() -> Iterator[MetricsEndpoints]:
    endpoints = MetricsEndpoints()
    yield endpoints
    endpoints.close()


@pytest.fixture(scope="module")
def operator(chart, metrics, tmp_path_factory) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    proc = OperatorProcess(chart.operator_kubeconfig, log, f"--peering={RELEASE}", env=metrics.templates())
    try:
        # Joined the chart's peering object, alone there: it leads.
        wait_for(lambda: proc.proc.poll() is None and any(
            p.get("lifetime", 0) > 0
            for p in (chart.kube.get("clusterkopfpeering", RELEASE, "") or {}).get("status", {}).values()),
            timeout=90, what="the operator to join the peering")
        yield proc
    finally:
        code = proc.stop()
        assert code == 0, proc.text()[-3000:]


def example(namespace: str, **overrides) -> dict:
    body = yaml.safe_load((ROOT / "examples" / "inferenceservice.yaml").read_text())
    body["metadata"]["namespace"] = namespace
    body["spec"].update(overrides)
    return body


def small(name: str, namespace: str, **spec) -> dict:
    return {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": name, "namespace": namespace},
            "spec": {"model": {"uri": "/models/m"},
                     "autoscaling": {"intervalSeconds": 1, "scaleDownStabilizationSeconds": 0}, **spec}}


def condition(body: dict | None, ctype: str) -> dict | None:
    return next((x for x in ((body or {}).get("status") or {}).get("conditions", []) if x["type"] == ctype), None)


def children(kube, namespace: str, name: str) -> dict[str, list[dict]]:
    selector = f"{INSTANCE}={name}"
    return {kind: kube.items(kind, namespace, "-l", selector) for kind in ("deployments", "services", "configmaps")}


def test_example_creates_owned_children_status_columns_and_events(chart, operator, namespace):
    kube = chart.kube
    kube.apply(example(namespace))
    owner = wait_for(lambda: kube.get(c.SHORT_NAME, "stories", namespace), what="the InferenceService")
    found = wait_for(lambda: (got := children(kube, namespace, "stories"))
                     and len(got["deployments"]) == 3 and len(got["services"]) == 3 and got["configmaps"] and got,
                     what="3 Deployments, 3 Services and the ConfigMap")
    assert {d["metadata"]["name"] for d in found["deployments"]} == {f"stories-{r}" for r in c.ROLES}
    grace = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
             for d in found["deployments"]}
    assert grace == {"stories-prefill": 30, "stories-decode": 30, "stories-gateway": 35}
    for child in found["deployments"] + found["services"] + found["configmaps"]:
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (c.KIND, "stories",
                                                                             owner["metadata"]["uid"], True)
    # The real Deployment controller took them over (ReplicaSets; pods stay Pending without a kubelet).
    wait_for(lambda: len(kube.items("replicasets", namespace, "-l", f"{INSTANCE}=stories")) == 3,
             what="ReplicaSets from kube-controller-manager")

    body = wait_for(lambda: (b := kube.get(c.SHORT_NAME, "stories", namespace))
                    and (b.get("status") or {}).get("observedGeneration") == b["metadata"]["generation"] and b,
                    what="status.observedGeneration")
    assert c.FINALIZER in body["metadata"]["finalizers"]
    ready = condition(body, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ReplicasNotReady")  # no kubelet: nothing runs
    assert {x["type"] for x in body["status"]["conditions"]} == {"Ready", "PrefillReady", "DecodeReady",
                                                                 "GatewayReady"}
    assert body["status"]["replicas"]["gateway"] == {"desired": 2, "ready": 0}

    header, row = kube.run("get", c.SHORT_NAME, "stories", "-n", namespace).stdout.splitlines()
    assert header.split() == ["NAME", "READY", "PREFILL", "DECODE", "GATEWAY", "URL", "AGE"]
    assert row.split()[:6] == ["stories", "False", "0", "0", "0",
                               f"http://stories-gateway.{namespace}.svc.cluster.local:8000"]

    event = wait_for(lambda: next((e for e in kube.events(namespace, "stories") if e["reason"] == "Applied"
                                   and "Deployment stories-decode" in e["message"]), None),
                     what="an Applied Event naming the decode Deployment")
    assert event["involvedObject"]["uid"] == owner["metadata"]["uid"]


def test_spec_change_rolls_out(chart, operator, namespace):
    kube = chart.kube
    kube.apply(small("demo", namespace))
    wait_for(lambda: kube.get("deployment", "demo-decode", namespace), what="the decode Deployment")
    kube.run("patch", c.SHORT_NAME, "demo", "-n", namespace, "--type=merge",
             "-p", '{"spec": {"decode": {"args": ["--max-num-seqs", "8"]}, "model": {"dtype": "float32"}}}')

    def rolled() -> bool:
        args = kube.get("deployment", "demo-decode", namespace)["spec"]["template"]["spec"]["containers"][0]["args"]
        return args[-2:] == ["--max-num-seqs", "8"] and "float32" in args

    wait_for(rolled, what="the decode Deployment to carry the new spec")
    body = wait_for(lambda: (b := kube.get(c.SHORT_NAME, "demo", namespace))
                    and b["status"].get("observedGeneration") == 2 and b, what="observedGeneration 2")
    assert body["metadata"]["generation"] == 2
    config = kube.get("configmap", "demo-config", namespace)
    assert config["data"]["KVRELAY_DTYPE"] == "float32"


def test_lora_adapters_reach_every_role_and_the_api_server_refuses_a_name_twice(chart, operator, namespace):
    kube = chart.kube
    twice = small("lora", namespace)
    twice["spec"]["model"]["loraAdapters"] = [{"name": "sql", "uri": "/a/sql"}, {"name": "sql", "uri": "/a/other"}]
    refused = kube.apply(twice, check=False)
    assert refused.returncode != 0 and "Duplicate value" in refused.stderr, refused.stderr
    ok = small("lora", namespace)
    ok["spec"]["model"]["loraAdapters"] = [{"name": "sql", "uri": "/a/sql"}]
    ok["spec"]["model"]["aliases"] = ["m-latest"]
    kube.apply(ok)

    def args(role: str) -> list[str]:
        d = kube.get("deployment", f"lora-{role}", namespace)
        return d["spec"]["template"]["spec"]["containers"][0]["args"] if d else []

    for role in c.ROLES:
        wait_for(lambda role=role: "sql=/a/sql" in args(role), what=f"the {role} Deployment to serve the adapter")
        assert args(role)[args(role).index("--lora-modules") + 1] == "sql=/a/sql"
    gateway = args("gateway")
    assert gateway[gateway.index("--served-model-name") + 1:][:2] == ["lora", "m-latest"]


def test_an_embedding_model_runs_serve_alone_and_retires_the_workers(chart, operator, namespace):
    """spec.model.runner: pooling on the real API server: the CRD refuses other runners; a service
    switched from generate to pooling runs `kvrelay serve --runner pooling` in its gateway pods,
    scales its workers to zero, and reads Ready from the gateway alone."""
    kube = chart.kube
    bad = small("emb", namespace)
    bad["spec"]["model"]["runner"] = "embed"
    refused = kube.apply(bad, check=False)
    assert refused.returncode != 0 and "Unsupported value" in refused.stderr, refused.stderr
    kube.apply(small("emb", namespace))
    wait_for(lambda: kube.get("deployment", "emb-decode", namespace), what="the decode Deployment")
    pooling = small("emb", namespace)
    pooling["spec"]["model"]["runner"] = "pooling"
    kube.apply(pooling)

    def gateway_args() -> list[str]:
        d = kube.get("deployment", "emb-gateway", namespace)
        return d["spec"]["template"]["spec"]["containers"][0]["args"] if d else []

    wait_for(lambda: gateway_args()[:3] == ["serve", "--runner", "pooling"], what="the gateway pods to run serve")
    for role in ("prefill", "decode"):
        wait_for(lambda role=role: kube.get("deployment", f"emb-{role}", namespace)["spec"]["replicas"] == 0,
                 what=f"the {role} Deployment scaled to zero")
    body = wait_for(lambda: (b := kube.get(c.SHORT_NAME, "emb", namespace))
                    and (condition(b, "PrefillReady") or {}).get("reason") == "NotRun" and b,
                    what="the workers' conditions to read NotRun")
    assert body["status"]["replicas"]["decode"] == {"desired": 0, "ready": 0}
    ready = condition(body, "Ready")
    assert ready["status"] == "False" and "GatewayReady" in ready["message"]  # no kubelet runs pods here
    assert "PrefillReady" not in ready["message"] and "DecodeReady" not in ready["message"]


def test_child_edited_or_deleted_by_hand_is_restored(chart, operator, namespace):
    kube = chart.kube
    kube.apply(small("demo", namespace))
    wait_for(lambda: len(children(kube, namespace, "demo")["deployments"]) == 3, what="the Deployments")
    kube.run("set", "image", "deployment/demo-gateway", "gateway=someone/else:1", "-n", namespace)
    kube.run("delete", "service", "demo-prefill", "-n", namespace)
    kube.run("delete", "configmap", "demo-config", "-n", namespace)

    def image() -> str:
        return kube.get("deployment", "demo-gateway", namespace)["spec"]["template"]["spec"]["containers"][0]["image"]

    wait_for(lambda: image() == "kvrelay:test", what="the gateway image restored")
    wait_for(lambda: kube.get("service", "demo-prefill", namespace), what="the prefill Service recreated")
    wait_for(lambda: kube.get("configmap", "demo-config", namespace), what="the ConfigMap recreated")
    assert len(children(kube, namespace, "demo")["services"]) == 3


def test_invalid_spec_becomes_a_condition_and_an_event_without_a_crash_loop(chart, operator, namespace):
    kube = chart.kube
    name = "n" * 60  # the API accepts it; the children's names would pass 63 characters
    kube.apply(small(name, namespace))
    ready = wait_for(lambda: condition(kube.get(c.SHORT_NAME, name, namespace), "Ready"), what="a Ready condition")
    assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
    assert "metadata.name is 60 characters" in ready["message"]
    event = wait_for(lambda: [e for e in kube.events(namespace, name) if e["reason"] == "InvalidSpec"],
                     what="an InvalidSpec Event")[0]
    assert event["type"] == "Warning" and "metadata.name" in event["message"]
    # Once kopf recorded the pass as handled, nothing should write the object again.
    handled = wait_for(lambda: (b := kube.get(c.SHORT_NAME, name, namespace))
                       and "kopf.zalando.org/last-handled-configuration" in b["metadata"].get("annotations", {}) and b,
                       what="kopf to record the handled spec")
    version = handled["metadata"]["resourceVersion"]
    time.sleep(3)  # three daemon intervals: the same verdict is not written again, nothing crashes
    assert kube.get(c.SHORT_NAME, name, namespace)["metadata"]["resourceVersion"] == version
    assert len([e for e in kube.events(namespace, name) if e["reason"] == "InvalidSpec"]) == 1
    assert operator.proc.poll() is None and "Traceback" not in operator.text()
    assert children(kube, namespace, name)["deployments"] == []


def test_multi_node_role_needs_the_leaderworkerset_crd_then_becomes_one(chart, operator, namespace):
    """Beyond gpusPerNode with no LWS CRD: InvalidSpec naming the CRD. Once it is installed: a
    LeaderWorkerSet of node groups, the nodes' token Secret, and the role's Deployment scaled to 0;
    back within one node, the other way round."""
    kube = chart.kube
    one_node = {"parallelism": {"tensor": 2, "gpusPerNode": 2}}
    kube.apply(small("multi", namespace, decode=one_node))
    wait_for(lambda: kube.get("deployment", "multi-decode", namespace), what="the decode Deployment")
    assert kube.get("crd", LWS_CRD, "") is None, "the LeaderWorkerSet CRD must be absent at first"
    kube.run("patch", c.SHORT_NAME, "multi", "-n", namespace, "--type=merge",
             "-p", '{"spec": {"decode": {"parallelism": {"gpusPerNode": 1}}}}')
    ready = wait_for(lambda: (r := condition(kube.get(c.SHORT_NAME, "multi", namespace), "Ready"))
                     and r["reason"] == "InvalidSpec" and r, what="an InvalidSpec condition")
    assert ready["status"] == "False" and c.LWS_CRD in ready["message"] and "2 nodes" in ready["message"]

    kube.run("apply", "-f", str(ROOT / "tests" / "operator" / "manifests" / "leaderworkerset-crd.yaml"))
    kube.run("wait", "--for=condition=Established", f"crd/{LWS_CRD}", "--timeout=60s")
    lws = wait_for(lambda: kube.get(c.LWS_PLURAL, "multi-decode", namespace), timeout=90,
                   what="the decode LeaderWorkerSet")
    assert lws["metadata"]["ownerReferences"][0]["name"] == "multi"
    tpl = lws["spec"]["leaderWorkerTemplate"]
    assert tpl["size"] == 2
    assert tpl["leaderTemplate"]["spec"]["containers"][0]["args"][-4:] == [
        "--nnodes", "2", "--dist-init-addr", "$(LWS_LEADER_ADDRESS):29500"]
    assert tpl["workerTemplate"]["spec"]["containers"][0]["args"][0] == "parallel-worker"
    assert tpl["leaderTemplate"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    secret = kube.get("secret", "multi-parallel-token", namespace)
    assert secret["data"]["token"] and secret["metadata"]["ownerReferences"][0]["name"] == "multi"
    wait_for(lambda: kube.get("deployment", "multi-decode", namespace)["spec"]["replicas"] == 0,
             what="the one-node Deployment scaled to 0")
    wait_for(lambda: condition(kube.get(c.SHORT_NAME, "multi", namespace), "Ready")["reason"] != "InvalidSpec",
             what="the InvalidSpec condition cleared")

    kube.run("patch", c.SHORT_NAME, "multi", "-n", namespace, "--type=merge",
             "-p", '{"spec": {"decode": {"parallelism": {"gpusPerNode": 2}}}}')
    wait_for(lambda: kube.get("deployment", "multi-decode", namespace)["spec"]["replicas"] == 1,
             what="the Deployment back")
    wait_for(lambda: kube.get(c.LWS_PLURAL, "multi-decode", namespace)["spec"]["replicas"] == 0,
             what="the LeaderWorkerSet scaled to 0")
    assert kube.get("secret", "multi-parallel-token", namespace)["data"] == secret["data"]  # created once


def test_autoscaler_scales_real_deployments_to_zero_and_back(chart, operator, metrics, namespace):
    kube = chart.kube
    metrics.set_load(namespace, "demo")  # idle
    kube.apply(small("demo", namespace,
                     prefill={"replicas": 1, "minReplicas": 0, "maxReplicas": 4},
                     decode={"replicas": 1, "minReplicas": 0, "maxReplicas": 6},
                     autoscaling={"intervalSeconds": 1, "targetPerReplica": 2, "scaleDownStabilizationSeconds": 0,
                                  "maxStepReplicas": 10}))

    def replicas(role: str) -> int:
        return kube.get("deployment", f"demo-{role}", namespace)["spec"]["replicas"]

    def at(prefill: int, decode: int) -> bool:
        return replicas("prefill") == prefill and replicas("decode") == decode

    wait_for(lambda: at(0, 0), what="both roles scaled to zero")
    # The Deployment controller follows: the ReplicaSets go to zero too.
    wait_for(lambda: all(rs["spec"]["replicas"] == 0 for rs in kube.items("replicasets", namespace, "-l",
                                                                          f"{c.LABEL_COMPONENT} in (prefill,decode)")),
             what="ReplicaSets at zero")
    metrics.set_load(namespace, "demo", prefill_queue=5)  # queued at the gateway: wake prefill (ceil 5/2) and decode
    wait_for(lambda: at(3, 1), what="prefill 3, decode 1")
    metrics.set_load(namespace, "demo", prefill_waiting=8, decode_waiting=8)  # the workers' own backlogs
    wait_for(lambda: at(4, 4), what="prefill 4 (its max), decode 4")
    metrics.set_load(namespace, "demo")
    wait_for(lambda: at(0, 0), what="both back to zero")
    status = kube.get(c.SHORT_NAME, "demo", namespace)["status"]["autoscaler"]
    assert status["decode"]["reason"] in ("ScaleToZero", "Idle")
    messages = " | ".join(e["message"] for e in kube.events(namespace, "demo") if e["reason"] == "Scaled")
    assert "prefill: 0 -> 3 replicas (WakeUp" in messages and "decode: 1 -> 4 replicas" in messages
    assert metrics.scrapes > 0


def test_delete_leaves_nothing_and_releases_the_finalizer(chart, operator, namespace):
    kube = chart.kube
    kube.apply(small("demo", namespace))
    wait_for(lambda: len(kube.items("replicasets", namespace, "-l", f"{INSTANCE}=demo")) == 3, what="ReplicaSets")
    kube.run("delete", c.SHORT_NAME, "demo", "-n", namespace, "--wait=false")
    wait_for(lambda: kube.get(c.SHORT_NAME, "demo", namespace) is None, what="the finalizer released")
    wait_for(lambda: not any(children(kube, namespace, "demo").values())
             and not kube.items("replicasets", namespace) and not kube.items("pods", namespace),
             what="the garbage collector to remove every child")


def test_chart_role_grants_only_what_the_operator_uses(chart, operator, namespace):
    """Runs last in this module: the audit log then holds every call of the tests above."""
    kube = chart.kube
    granted = {(group, resource, verb) for rule in c.RBAC_RULES for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    calls = wait_for(lambda: (got := audited_calls(chart.audit_log))["allow"] and got, what="audit events")
    assert not calls["forbid"], f"the API server refused the operator: {calls['forbid']}"
    used = calls["allow"]
    assert used <= granted, f"the operator called outside its role: {used - granted}"
    # Not visible as requests: server-side apply that creates an object is authorized as `create`
    # too, and blockOwnerDeletion needs `update` on the owner's finalizers (admission). Shown
    # here by the API server refusing exactly that call to a role without the verb.
    kube.apply(small("demo", namespace, model={"uri": "/m"}))
    uid = wait_for(lambda: kube.get(c.SHORT_NAME, "demo", namespace))["metadata"]["uid"]
    owner = {"apiVersion": c.API_VERSION, "kind": c.KIND, "name": "demo", "uid": uid, "controller": True,
             "blockOwnerDeletion": True}
    probes = {
        ("apps", "deployments", "create"): {"apiVersion": "apps/v1", "kind": "Deployment", "spec": {
            "selector": {"matchLabels": {"a": "b"}}, "template": {"metadata": {"labels": {"a": "b"}}, "spec": {
                "containers": [{"name": "c", "image": "i"}]}}}},
        ("", "services", "create"): {"apiVersion": "v1", "kind": "Service", "spec": {"ports": [{"port": 80}]}},
        ("", "configmaps", "create"): {"apiVersion": "v1", "kind": "ConfigMap", "data": {}},
        (c.GROUP, f"{c.PLURAL}/finalizers", "update"): {"apiVersion": "v1", "kind": "ConfigMap", "data": {}},
        # (the LeaderWorkerSet CRD is installed by test_multi_node_role_needs_the_leaderworkerset_crd...)
        (c.LWS_GROUP, c.LWS_PLURAL, "create"): {"apiVersion": c.LWS_API_VERSION, "kind": c.LWS_KIND, "spec": {}},
    }
    assert granted - used <= set(probes), f"granted but never used: {granted - used - set(probes)}"
    for i, ((group, resource, verb), obj) in enumerate(sorted(probes.items())):
        account = f"without-{i}"
        rules = [dict(rule, verbs=[v for v in rule["verbs"] if v != verb])
                 if group in rule["apiGroups"] and resource in rule["resources"] else rule
                 for rule in c.RBAC_RULES]  # the role, less this one verb
        kube.apply([
            {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account, "namespace": namespace}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
             "metadata": {"name": account, "namespace": namespace},
             "rules": [r for r in rules if r["verbs"] and r["apiGroups"] != ["kopf.dev"]]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": {"name": account, "namespace": namespace},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
             "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]}])
        child = dict(obj, metadata={"name": f"probe-{i}", "namespace": namespace, "ownerReferences": [owner]})
        as_account = f"--as=system:serviceaccount:{namespace}:{account}"
        refused = kube.apply(child, "--server-side", "--field-manager", c.FIELD_MANAGER, as_account, check=False)
        assert refused.returncode != 0, f"{resource} {verb} was not needed: {refused.stdout}"
        assert "forbidden" in refused.stderr.lower(), refused.stderr
        assert ("finalizers" in refused.stderr) == (verb == "update"), refused.stderr
