"""Replica arithmetic of the queue-depth autoscaler, with no I/O.

It follows the Kubernetes HPA algorithm: desired = ceil(current × metric / target), no change
within a relative tolerance, per-direction stabilization windows over past recommendations,
min/max bounds and a cap on the step size. On top of it, scale to zero and wake-up: a role whose
minReplicas is 0 goes to zero only while the whole pipeline is idle for it, and comes back as
soon as work is queued for it or for the role it hands requests to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvrelay.operator.spec import AutoscalingSpec, RoleSpec

EPSILON = 1e-9  # keeps ceil(4.0000000001) from becoming 5


@dataclass(frozen=True)
class Signals:
    """Load of one InferenceService at one instant, summed over pods."""

    prefill_queue: float = 0.0  # requests waiting for prefill (gateway queue + prefill workers' waiting)
    decode_queue: float = 0.0  # requests waiting for decode (gateway queue + decode workers' waiting)
    prefill_running: float = 0.0  # requests in prefill workers (waiting + running)
    decode_running: float = 0.0  # requests generating on decode workers
    decode_kv_usage: float | None = None  # mean KV-cache usage of decode workers, 0-1

    def queue(self, role: str) -> float:
        return self.prefill_queue if role == "prefill" else self.decode_queue

    def busy_floor(self, role: str) -> bool:
        """Whether this role must keep at least one replica so no request is stuck."""
        if role == "prefill":
            return self.prefill_queue > 0 or self.prefill_running > 0 or self.decode_queue > 0
        return (self.decode_queue > 0 or self.decode_running > 0
                or self.prefill_queue > 0 or self.prefill_running > 0)


@dataclass(frozen=True)
class Decision:
    role: str
    current: int
    desired: int
    recommendation: int  # before stabilization, step cap and bounds
    metric_value: float  # queued requests per current replica (total when current is 0)
    target: float
    reason: str
    time: float

    @property
    def changes(self) -> bool:
        return self.desired != self.current

    def key(self) -> tuple[int, int, float, str]:
        """What makes two decisions different for status and Events (time excluded)."""
        return (self.current, self.desired, round(self.metric_value, 3), self.reason)


def ratio_recommendation(current: int, load: float, target: float, tolerance: float) -> int:
    """HPA core: ceil(current × (load/current) / target), unchanged within the tolerance."""
    if current == 0:
        return math.ceil(load / target - EPSILON) if load > 0 else 0
    ratio = (load / current) / target
    if abs(ratio - 1.0) <= tolerance:
        return current
    return math.ceil(current * ratio - EPSILON)


@dataclass
class Stabilizer:
    """Per-role memory of recent recommendations (the HPA's stabilization windows)."""

    history: list[tuple[float, int]] = field(default_factory=list)

    def stabilize(self, now: float, recommendation: int, current: int, up_window: float, down_window: float) -> int:
        if not self.history:
            # A fresh autoscaler (new resource, restarted operator) has seen no load yet: count the
            # current replicas as the previous recommendation, so it waits a full window too.
            self.history.append((now - 1e-6, current))
        self.history.append((now, recommendation))
        horizon = max(up_window, down_window)
        self.history = [(t, r) for t, r in self.history if now - t <= horizon]
        # Scale up only as far as every recommendation of the up window agrees, and down only
        # as far as every recommendation of the down window agrees.
        up_floor = min(r for t, r in self.history if now - t <= up_window)
        down_ceiling = max(r for t, r in self.history if now - t <= down_window)
        if current < up_floor:
            return up_floor
        if current > down_ceiling:
            return down_ceiling
        return current


def decide(
    role: str,
    current: int,
    signals: Signals,
    role_spec: RoleSpec,
    scaling: AutoscalingSpec,
    stabilizer: Stabilizer,
    now: float,
) -> Decision:
    """One autoscaling decision for one role of one InferenceService."""
    target = scaling.target_per_replica
    load = signals.queue(role)
    recommendation = ratio_recommendation(current, load, target, scaling.tolerance)
    reason = "QueueDepth"
    if role == "decode" and signals.decode_kv_usage is not None and current > 0:
        kv_load = signals.decode_kv_usage * current  # as if KV usage were a per-replica metric
        kv_recommendation = ratio_recommendation(current, kv_load, scaling.kv_cache_usage_target, scaling.tolerance)
        if kv_recommendation > recommendation:
            recommendation, reason = kv_recommendation, "KVCacheUsage"
    bounded = min(max(recommendation, role_spec.min_replicas), role_spec.max_replicas)
    floored = bounded == 0 and signals.busy_floor(role) and role_spec.max_replicas > 0
    if floored:
        bounded = 1  # never strand a request on a scaled-to-zero role
    stabilized = stabilizer.stabilize(
        now, bounded, current, scaling.scale_up_stabilization_seconds, scaling.scale_down_stabilization_seconds
    )
    step = scaling.max_step_replicas
    desired = min(max(stabilized, current - step), current + step)
    desired = min(max(desired, role_spec.min_replicas), role_spec.max_replicas)
    if desired == current:
        if bounded != current:
            reason = "StabilizationWindow"  # a change is wanted but the window does not agree yet
        elif floored:
            reason = "PipelineBusy"
        elif recommendation != bounded:
            reason = "AtBound"
        elif current == 0 and load == 0:
            reason = "Idle"
        else:
            reason = "WithinTolerance"
    elif current == 0:
        reason = "WakeUp"
    elif desired == 0:
        reason = "ScaleToZero"
    elif desired != stabilized:
        reason = "StepLimited"
    elif floored:
        reason = "PipelineBusy"
    metric_value = load / current if current else load
    return Decision(role=role, current=current, desired=desired, recommendation=recommendation,
                    metric_value=metric_value, target=target, reason=reason, time=now)
