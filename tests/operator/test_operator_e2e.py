"""kopf end to end against kmock's Kubernetes emulator: children, status, rollout, drift, deletion."""

from __future__ import annotations

import asyncio

from kvrelay.operator import constants as c
from operator_harness import CONFIGMAPS, DEPLOYMENTS, EVENTS, ISVC, SERVICES, Cluster, eventually, isvc_body

NS = "default"
ISVC_PATH = f"/apis/{c.API_VERSION}/namespaces/{NS}/{c.PLURAL}/demo"


def deployment_path(name: str) -> str:
    return f"/apis/apps/v1/namespaces/{NS}/deployments/{name}"


def condition(cluster: Cluster, ctype: str, name: str = "demo") -> dict | None:
    body = cluster.live(ISVC, NS, name) or {}
    return next((cond for cond in (body.get("status") or {}).get("conditions", []) if cond["type"] == ctype), None)


def container(cluster: Cluster, name: str) -> dict:
    return cluster.live(DEPLOYMENTS, NS, name)["spec"]["template"]["spec"]["containers"][0]


def operator_requests(cluster: Cluster) -> list:
    return [r for r in list(cluster._requests) if r.headers.get("User-Agent", "").startswith("kopf")]


def rbac_verb(request) -> str:
    if request.method == "GET":
        if request.params.get("watch") == "true":
            return "watch"
        return "get" if request.name else "list"
    return {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}[request.method]


def allowed(group: str, resource: str, verb: str) -> bool:
    return any(group in rule["apiGroups"] and resource in rule["resources"] and verb in rule["verbs"]
               for rule in c.RBAC_RULES)


async def test_create_builds_children_owned_by_the_resource_and_reports_status(cluster, operator_runner):
    await cluster.create(isvc_body(tenants={"secretRef": {"name": "demo-tenants"}},
                                   redis={"url": "redis://redis.example:6379/0"}))
    operator_runner()
    await eventually(lambda: all(cluster.live(DEPLOYMENTS, NS, f"demo-{r}") for r in c.ROLES))
    owner_uid = cluster.live(ISVC, NS, "demo")["metadata"]["uid"]
    children = [cluster.live(DEPLOYMENTS, NS, f"demo-{r}") for r in c.ROLES]
    children += [cluster.live(SERVICES, NS, f"demo-{r}") for r in c.ROLES]
    children.append(await eventually(lambda: cluster.live(CONFIGMAPS, NS, "demo-config")))
    for child in children:
        assert child["metadata"]["ownerReferences"][0]["uid"] == owner_uid
        assert child["metadata"]["ownerReferences"][0]["controller"] is True
    assert cluster.live(SERVICES, NS, "demo-decode")["spec"]["clusterIP"] == "None"
    assert cluster.live(SERVICES, NS, "demo-gateway")["spec"]["type"] == "ClusterIP"
    assert container(cluster, "demo-prefill")["args"][:3] == ["prefill", "--model", "/models/stories260K"]
    gateway_args = container(cluster, "demo-gateway")["args"]
    assert "dns:///demo-decode.default.svc.cluster.local:50051" in gateway_args
    assert gateway_args[gateway_args.index("--tenants") + 1] == "/etc/kvrelay/tenants/tenants.yaml"
    assert container(cluster, "demo-gateway")["image"] == "kvrelay:test"

    # Nothing is ready until the Deployments report ready pods.
    ready = await eventually(lambda: condition(cluster, "Ready"))
    assert ready["status"] == "False" and ready["reason"] == "ReplicasNotReady"
    for role in c.ROLES:
        await cluster.patch_object(deployment_path(f"demo-{role}") + "/status",
                                   {"status": {"readyReplicas": 1, "replicas": 1}})
    await eventually(lambda: condition(cluster, "Ready")["status"] == "True")
    status = cluster.live(ISVC, NS, "demo")["status"]
    assert status["url"] == "http://demo-gateway.default.svc.cluster.local:8000"
    assert status["observedGeneration"] == 1
    assert status["replicas"]["decode"] == {"desired": 1, "ready": 1}
    assert {cond["type"] for cond in status["conditions"]} >= {"Ready", "PrefillReady", "DecodeReady", "GatewayReady"}

    # A Deployment past its progress deadline makes its role and the whole service not ready.
    await cluster.patch_object(deployment_path("demo-decode") + "/status", {"status": {"conditions": [
        {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
         "message": "ReplicaSet demo-decode-1 has timed out progressing."}]}})
    await eventually(lambda: condition(cluster, "DecodeReady")["reason"] == "ProgressDeadlineExceeded")
    assert condition(cluster, "Ready")["status"] == "False"

    # Every call the operator made is covered by the chart's least-privilege RBAC rules.
    for request in operator_requests(cluster):
        if request.resource is None or request.resource.plural is None:
            continue  # discovery: non-resource URLs
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        assert allowed(request.resource.group, resource, rbac_verb(request)), (request.method, request.url)


async def test_second_reconcile_of_an_unchanged_resource_writes_nothing(cluster, operator_runner):
    await cluster.create(isvc_body())
    operator_runner()
    await eventually(lambda: condition(cluster, "Ready"))
    watched = (DEPLOYMENTS, SERVICES, CONFIGMAPS, ISVC)

    async def settled() -> bool:  # creation done: kopf's and our first writes are over
        count = len(cluster.writes(*watched))
        await asyncio.sleep(1.5)
        return len(cluster.writes(*watched)) == count

    for _ in range(20):
        if await settled():
            break
    writes_before = len(cluster.writes(*watched))
    passes_before = sum(1 for r in list(cluster._requests) if r.method == "GET" and r.resource == DEPLOYMENTS)
    await asyncio.sleep(3.5)  # several reconcile passes at intervalSeconds=1
    passes = sum(1 for r in list(cluster._requests) if r.method == "GET" and r.resource == DEPLOYMENTS)
    assert passes >= passes_before + 6, "the daemon should have reconciled at least twice"
    new_writes = cluster.writes(*watched)[writes_before:]
    assert new_writes == [], [(r.method, str(r.url)) for r in new_writes]


async def test_spec_change_rolls_out(cluster, operator_runner):
    await cluster.create(isvc_body())
    operator_runner()
    await eventually(lambda: cluster.live(DEPLOYMENTS, NS, "demo-decode"))
    hash_before = cluster.live(DEPLOYMENTS, NS, "demo-decode")["spec"]["template"]["metadata"]["annotations"][
        c.ANNOTATION_CONFIG_HASH]
    await cluster.patch_object(ISVC_PATH, {"spec": {"model": {"uri": "/models/other", "dtype": "bfloat16"},
                                                    "gateway": {"replicas": 2, "maxReplicas": 2}}})
    await eventually(lambda: container(cluster, "demo-decode")["args"][2] == "/models/other")
    await eventually(lambda: cluster.live(CONFIGMAPS, NS, "demo-config")["data"]["KVRELAY_DTYPE"] == "bfloat16")
    await eventually(lambda: cluster.live(DEPLOYMENTS, NS, "demo-gateway")["spec"]["replicas"] == 2)
    annotations = cluster.live(DEPLOYMENTS, NS, "demo-decode")["spec"]["template"]["metadata"]["annotations"]
    assert annotations[c.ANNOTATION_CONFIG_HASH] != hash_before  # pods roll on settings changes
    await eventually(lambda: cluster.live(ISVC, NS, "demo")["status"]["observedGeneration"] == 2)


async def test_child_deleted_or_edited_by_hand_is_restored(cluster, operator_runner):
    await cluster.create(isvc_body())
    operator_runner()
    await eventually(lambda: cluster.live(DEPLOYMENTS, NS, "demo-decode") and cluster.live(SERVICES, NS, "demo-gateway"))
    await cluster.delete_object(deployment_path("demo-decode"))
    await cluster.delete_object(f"/api/v1/namespaces/{NS}/services/demo-gateway")
    assert cluster.live(DEPLOYMENTS, NS, "demo-decode") is None
    await eventually(lambda: cluster.live(DEPLOYMENTS, NS, "demo-decode"))
    await eventually(lambda: cluster.live(SERVICES, NS, "demo-gateway"))

    edited = dict(container(cluster, "demo-gateway"), image="someone/else:latest")
    await cluster.patch_object(deployment_path("demo-gateway"),
                               {"spec": {"template": {"spec": {"containers": [edited]}}}})
    assert container(cluster, "demo-gateway")["image"] == "someone/else:latest"
    await eventually(lambda: container(cluster, "demo-gateway")["image"] == "kvrelay:test")


async def test_invalid_spec_sets_condition_and_event_without_crashing(cluster, operator_runner):
    await cluster.create(isvc_body(decode={"minReplicas": 3, "maxReplicas": 1}))
    runner = operator_runner()
    ready = await eventually(lambda: condition(cluster, "Ready"))
    assert ready["status"] == "False" and ready["reason"] == "InvalidSpec"
    assert "spec.decode.minReplicas (3) must be <= spec.decode.maxReplicas (1)" in ready["message"]
    events = await eventually(lambda: [e.raw for k, e in cluster.objects.items()
                                       if k[0] == EVENTS and not e.deleted and e.raw.get("reason") == "InvalidSpec"])
    assert events[0]["involvedObject"]["name"] == "demo"
    assert cluster.live(DEPLOYMENTS, NS, "demo-decode") is None
    assert not runner.future.done()  # still running

    await cluster.patch_object(ISVC_PATH, {"spec": {"decode": {"maxReplicas": 4}}})
    await eventually(lambda: cluster.live(DEPLOYMENTS, NS, "demo-decode"))
    await eventually(lambda: condition(cluster, "Ready")["reason"] == "ReplicasNotReady")


async def test_delete_releases_the_finalizer_and_children_are_collected(cluster, operator_runner):
    await cluster.create(isvc_body())
    operator_runner()
    await eventually(lambda: cluster.live(DEPLOYMENTS, NS, "demo-gateway"))
    await eventually(lambda: c.FINALIZER in cluster.live(ISVC, NS, "demo")["metadata"].get("finalizers", []))
    await cluster.delete_object(ISVC_PATH)
    await eventually(lambda: cluster.live(ISVC, NS, "demo") is None)
    for role in c.ROLES:
        assert cluster.live(DEPLOYMENTS, NS, f"demo-{role}") is None
        assert cluster.live(SERVICES, NS, f"demo-{role}") is None
    assert cluster.live(CONFIGMAPS, NS, "demo-config") is None
