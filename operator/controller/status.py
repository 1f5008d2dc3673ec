"""The InferenceService's status: per-role readiness conditions from the live Deployments."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvrelay.operator import constants as c

CONDITION_TYPES = {"prefill": "PrefillReady", "decode": "DecodeReady", "gateway": "GatewayReady"}


@dataclass(frozen=True)
class Condition:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str = ""


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def role_condition(role: str, deployment: Mapping[str, Any] | None) -> tuple[Condition, int, int]:
    """(condition, desired replicas, ready replicas) of one role's Deployment."""
    ctype = CONDITION_TYPES[role]
    if deployment is None:
        return Condition(ctype, "False", "DeploymentMissing", f"Deployment for {role} not created yet"), 0, 0
    desired = int(deployment.get("spec", {}).get("replicas", 1) or 0)
    dstatus = deployment.get("status") or {}
    ready = int(dstatus.get("readyReplicas") or 0)
    for cond in dstatus.get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return Condition(ctype, "False", "ProgressDeadlineExceeded", cond.get("message") or ""), desired, ready
    if desired == 0:
        return Condition(ctype, "True", "ScaledToZero", "scaled to zero; a queued request wakes it"), 0, ready
    if ready >= 1:
        return Condition(ctype, "True", "MinimumReplicasAvailable", f"{ready}/{desired} replicas ready"), desired, ready
    return Condition(ctype, "False", "ReplicasNotReady", f"0/{desired} replicas ready"), desired, ready


def aggregate(conditions: list[Condition]) -> Condition:
    failing = [cond for cond in conditions if cond.status != "True"]
    if not failing:
        names = [cond.type.removesuffix("Ready").lower() for cond in conditions]
        return Condition("Ready", "True", "AllRolesReady", f"{', '.join(names)} {'are' if len(names) > 1 else 'is'} ready")
    first = failing[0]
    return Condition("Ready", "False", first.reason,
                     "; ".join(f"{cond.type}: {cond.message or cond.reason}" for cond in failing))


def merge_conditions(old: list[Mapping[str, Any]] | None, new: list[Condition]) -> list[dict[str, Any]]:
    """New conditions, keeping lastTransitionTime where a condition's status did not change."""
    previous = {cond.get("type"): cond for cond in old or []}
    merged = {t: dict(cond) for t, cond in previous.items() if t}
    for cond in new:
        before = previous.get(cond.type) or {}
        changed = before.get("status") != cond.status
        merged[cond.type] = {
            "type": cond.type,
            "status": cond.status,
            "reason": cond.reason,
            "message": cond.message,
            "lastTransitionTime": now_iso() if changed or not before.get("lastTransitionTime")
            else before["lastTransitionTime"],
        }
    order = ["Ready", *CONDITION_TYPES.values()]
    return sorted(merged.values(), key=lambda cond: order.index(cond["type"]) if cond["type"] in order else 99)


def roles_status(deployments: Mapping[str, Mapping[str, Any] | None],
                 roles: tuple[str, ...] = c.ROLES) -> tuple[list[Condition], dict[str, Any]]:
    """Every role's condition and replicas; Ready weighs the roles the service runs (an embedding
    model's roles not run read NotRun, with no replicas)."""
    conditions, replicas, run = [], {}, []
    for role in c.ROLES:
        if role in roles:
            cond, desired, ready = role_condition(role, deployments.get(role))
            run.append(cond)
        else:
            cond, desired, ready = Condition(CONDITION_TYPES[role], "True", "NotRun",
                                             f"an embedding model runs no {role} workers"), 0, 0
        conditions.append(cond)
        replicas[role] = {"desired": desired, "ready": ready}
    return [aggregate(run), *conditions], replicas


def is_subset(part: Any, whole: Any) -> bool:
    """Whether every field of `part` is present with the same value in `whole` (lists: pairwise)."""
    if isinstance(part, Mapping):
        return isinstance(whole, Mapping) and all(k in whole and is_subset(v, whole[k]) for k, v in part.items())
    if isinstance(part, list):
        return (isinstance(whole, list) and len(part) == len(whole)
                and all(is_subset(p, w) for p, w in zip(part, whole)))
    return part == whole
