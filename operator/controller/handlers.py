"""kopf handlers: InferenceService -> ConfigMap, Services and Deployments, status, autoscaling.

Create, update and resume reconcile at once; a per-resource daemon then repeats the pass every
`spec.autoscaling.intervalSeconds`: it repairs drifted or deleted children, refreshes the status
and runs the autoscaler. Children carry owner references, so deletion is garbage collection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import kopf
from kvrelay.operator import constants as c
from kvrelay.operator.autoscale import Decision, Stabilizer, decide
from kvrelay.operator.builders import WORKLOAD_KINDS, Owner, build_children, gateway_url, hashed_content
from kvrelay.operator.config import OperatorConfig
from kvrelay.operator.kube import APIError, KubeClient, object_path, path_of
from kvrelay.operator.leaderworkerset import build_token_secret, missing_crd_error, uses_lws, workload_kinds
from kvrelay.operator.metrics import MetricsUnavailable, read_signals
from kvrelay.operator.peering import require_peering
from kvrelay.operator.spec import InferenceServiceSpec, InvalidSpec, parse_spec
from kvrelay.operator.status import Condition, is_subset, merge_conditions, roles_status

RESOURCE = (c.GROUP, c.VERSION, c.PLURAL)


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    settings.persistence.finalizer = c.FINALIZER
    settings.posting.level = logging.INFO  # Events for scaling decisions and invalid specs
    settings.posting.loggers = False  # only those explicit Events, not every log line
    settings.watching.server_timeout = 300
    memo.settings = settings  # resource handlers get no `settings` kwarg
    memo.config = OperatorConfig.from_env()
    if not settings.peering.standalone:
        # The API is usable only once start-up is over (kopf logs in after it): check in the background.
        memo.peering_check = asyncio.create_task(require_peering(KubeClient(settings, logger), settings.peering.name,
                                                                 memo))
    logger.info("leader election off (--standalone): this replica handles every InferenceService"
                if settings.peering.standalone else
                f"leader election through ClusterKopfPeering {settings.peering.name!r} "
                f"(priority {settings.peering.priority}, lifetime {settings.peering.lifetime}s)")
    memo.http = aiohttp.ClientSession()  # for scraping /metrics


@kopf.on.cleanup()
async def close(memo: kopf.Memo, **_: Any) -> None:
    check = memo.get("peering_check")
    if check is not None:
        check.cancel()
    http = memo.get("http")
    if http is not None:
        await http.close()


def owner_of(body: kopf.Body) -> Owner:
    return Owner(name=body["metadata"]["name"], namespace=body["metadata"]["namespace"],
                 uid=body["metadata"].get("uid", ""))


def needs_apply(desired: dict[str, Any], live: dict[str, Any] | None) -> bool:
    """Apply when missing, when the spec hash moved, or when someone edited our fields by hand."""
    if live is None or live.get("metadata", {}).get("deletionTimestamp"):
        return True
    if not is_subset(hashed_content(desired), live):
        return True
    if desired["kind"] in WORKLOAD_KINDS and desired["spec"]["replicas"] != live.get("spec", {}).get("replicas"):
        return True
    return not is_subset(desired["metadata"]["annotations"], live.get("metadata", {}).get("annotations") or {})


async def apply_children(client: KubeClient, owner: Owner, spec: InferenceServiceSpec, config: OperatorConfig,
                         applied: list[str] | None = None) -> dict[str, dict[str, Any] | None]:
    """Bring every child to its desired state; returns the live workloads (Deployments, or
    LeaderWorkerSets for engines over several nodes) by role and adds "Kind name" of each child it
    wrote to `applied`. Raises InvalidSpec when a LeaderWorkerSet is needed and its CRD is missing."""
    if any(uses_lws(spec, role) for role in spec.roles) and not await client.api_served(c.LWS_API_VERSION):
        raise missing_crd_error(spec)
    for role in set(c.ROLES) - set(spec.roles):  # an embedding model runs no workers: stop any left running
        await scale_other_kind_to_zero(client, owner, spec, role, applied, both=True)
    paths = {role: object_path(*workload_kinds(spec, role)[0], owner.namespace, f"{owner.name}-{role}")
             for role in spec.roles}
    deployments = {role: await client.get(path) for role, path in paths.items()}
    live_replicas = {role: (d or {}).get("spec", {}).get("replicas") for role, d in deployments.items()}
    for desired in build_children(owner, spec, config, live_replicas):
        path = path_of(desired)
        role = desired["metadata"]["labels"].get(c.LABEL_COMPONENT)
        workload = desired["kind"] in WORKLOAD_KINDS
        live = deployments[role] if workload else await client.get(path)
        if needs_apply(desired, live):
            client.logger.info(f"applying {desired['kind']} {desired['metadata']['name']}")
            if desired["kind"] == c.LWS_KIND and live is None:  # its pods' shared token, before they start
                await client.create_once(build_token_secret(owner))
            if workload and role in c.WORKER_ROLES:  # created or changed: maybe moved between kinds
                await scale_other_kind_to_zero(client, owner, spec, role, applied)
            live = await client.apply(desired)
            if applied is not None:
                applied.append(f"{desired['kind']} {desired['metadata']['name']}")
            if workload:
                deployments[role] = live
    return deployments


async def scale_other_kind_to_zero(client: KubeClient, owner: Owner, spec: InferenceServiceSpec, role: str,
                                   applied: list[str] | None, both: bool = False) -> None:
    """A role that moved between one node (Deployment) and several (LeaderWorkerSet) stops the
    pods of its other workload (both: of either kind, for a role the spec no longer runs); the
    object stays until the InferenceService goes (garbage collection)."""
    for kind in workload_kinds(spec, role)[0 if both else 1:]:
        if kind[1] == c.LWS_KIND and not await client.api_served(c.LWS_API_VERSION):
            continue
        path = object_path(*kind, owner.namespace, f"{owner.name}-{role}")
        stale = await client.get(path)
        if stale is not None and stale.get("spec", {}).get("replicas"):
            await client.merge_patch(path, {"spec": {"replicas": 0}}, c.FIELD_MANAGER)
            if applied is not None:
                applied.append(f"{kind[1]} {owner.name}-{role} (scaled to 0)")


async def write_status(client: KubeClient, body: kopf.Body, patch: dict[str, Any]) -> bool:
    """Merge-patch the status subresource only if something differs: steady state writes nothing."""
    if is_subset(patch, dict(body.get("status") or {})):
        return False
    path = object_path(c.API_VERSION, c.KIND, body["metadata"]["namespace"], body["metadata"]["name"]) + "/status"
    await client.merge_patch(path, {"status": patch}, c.FIELD_MANAGER)
    return True


def invalid_status(body: kopf.Body, error: InvalidSpec) -> dict[str, Any]:
    old = (body.get("status") or {}).get("conditions")
    return {
        "observedGeneration": body["metadata"].get("generation"),
        "conditions": merge_conditions(old, [Condition("Ready", "False", "InvalidSpec", str(error))]),
    }


async def reconcile(body: kopf.Body, memo: kopf.Memo, client: KubeClient, autoscale: bool) -> None:
    """One full pass; invalid input becomes a condition and an Event, never an exception."""
    owner = owner_of(body)
    lock = memo.setdefault("lock", asyncio.Lock())
    async with lock:
        try:
            spec = parse_spec(body.get("spec"), owner.name)
            applied: list[str] = []
            try:
                deployments = await apply_children(client, owner, spec, memo.config, applied)
            finally:
                if applied:  # created, rolled out or repaired: visible in `kubectl describe`
                    kopf.info(body, reason="Applied", message="applied " + ", ".join(applied))
        except InvalidSpec as e:
            if await write_status(client, body, invalid_status(body, e)):
                kopf.warn(body, reason="InvalidSpec", message=str(e))
            return
        decisions = await run_autoscaler(client, body, owner, spec, deployments, memo) if autoscale else {}
        conditions, replicas = roles_status(deployments, spec.roles)
        status: dict[str, Any] = {
            "observedGeneration": body["metadata"].get("generation"),
            "url": gateway_url(owner),
            "conditions": merge_conditions((body.get("status") or {}).get("conditions"), conditions),
            "replicas": replicas,
        }
        if decisions:
            status["autoscaler"] = decisions
        await write_status(client, body, status)


def decision_status(decision: Decision) -> dict[str, Any]:
    return {
        "current": decision.current,
        "desired": decision.desired,
        "recommendation": decision.recommendation,
        "metricValue": round(decision.metric_value, 3),
        "target": decision.target,
        "reason": decision.reason,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(decision.time)),
    }


async def run_autoscaler(client: KubeClient, body: kopf.Body, owner: Owner, spec: InferenceServiceSpec,
                         deployments: dict[str, dict[str, Any] | None], memo: kopf.Memo) -> dict[str, Any]:
    """Scale prefill and decode on queue depth; returns the status entry per autoscaled role."""
    roles = [role for role in c.WORKER_ROLES if spec.role(role).autoscaled and deployments.get(role)]
    recorded: dict[str, Any] = memo.setdefault("decisions", {})  # role -> (key, status entry)
    if not roles:
        return {}
    stabilizers: dict[str, Stabilizer] = memo.setdefault("stabilizers", {})
    try:
        signals = await read_signals(memo.http, memo.config, owner)
    except MetricsUnavailable as e:
        client.logger.warning(f"autoscaler holds replicas: {e}")
        return {role: entry for role, (_, entry) in recorded.items() if role in roles}
    now = time.time()
    out: dict[str, Any] = {}
    for role in roles:
        deployment = deployments[role] or {}
        current = int(deployment.get("spec", {}).get("replicas") or 0)
        decision = decide(role, current, signals, spec.role(role), spec.autoscaling,
                          stabilizers.setdefault(role, Stabilizer()), now)
        if decision.changes:
            path = path_of(deployment) if "apiVersion" in deployment else object_path(
                *workload_kinds(spec, role)[0], owner.namespace, f"{owner.name}-{role}")
            deployments[role] = await client.merge_patch(path, {"spec": {"replicas": decision.desired}},
                                                         c.SCALER_FIELD_MANAGER)
        previous = recorded.get(role)
        if previous is None or previous[0] != decision.key():
            recorded[role] = (decision.key(), decision_status(decision))
            if decision.changes or previous is not None:
                kopf.info(body, reason="Scaled" if decision.changes else "ScalingDecision",
                          message=f"{role}: {decision.current} -> {decision.desired} replicas "
                                  f"({decision.reason}; {decision.metric_value:.2f} queued per replica, "
                                  f"target {decision.target:g})")
        out[role] = recorded[role][1]
    return out


@kopf.on.resume(*RESOURCE)
@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE, field="spec")
async def on_change(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    try:
        await reconcile(body, memo, KubeClient(memo.settings, logger), autoscale=False)
    except APIError as e:
        raise kopf.TemporaryError(f"Kubernetes API error while reconciling: {e!r}", delay=5) from e


@kopf.daemon(*RESOURCE, cancellation_timeout=5.0, initial_delay=1.0)
async def keep_in_sync(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger,
                       stopped: kopf.DaemonStopped, **_: Any) -> None:
    """Drift repair, status refresh and autoscaling, every intervalSeconds until deletion."""
    client = KubeClient(memo.settings, logger)
    while not stopped:
        try:
            await reconcile(body, memo, client, autoscale=True)
        except Exception:  # one failed pass must not stop drift repair or scaling
            logger.exception("reconcile pass failed, retrying next interval")
        try:
            interval = parse_spec(body.get("spec"), body["metadata"]["name"]).autoscaling.interval_seconds
        except InvalidSpec:
            interval = 15
        await stopped.wait(interval)


@kopf.on.delete(*RESOURCE)
async def on_delete(body: kopf.Body, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    # Children are removed by the garbage collector through their owner references; only the
    # autoscaler's in-memory history of this resource is ours to drop.
    for key in ("stabilizers", "decisions"):
        memo.pop(key, None)
    logger.info(f"InferenceService {body['metadata']['name']} deleted; children go with it")
