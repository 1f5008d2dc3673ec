"""The autoscaler's arithmetic: HPA ratio, tolerance, stabilization windows, bounds, step cap,
scale to zero and wake-up, prefill/decode coordination."""

from __future__ import annotations

from kvrelay.operator.autoscale import Signals, Stabilizer, decide, ratio_recommendation
from kvrelay.operator.spec import AutoscalingSpec, RoleSpec

ROLE = RoleSpec(replicas=1, min_replicas=1, max_replicas=10)
ZERO_ROLE = RoleSpec(replicas=1, min_replicas=0, max_replicas=10)
FAST = AutoscalingSpec(target_per_replica=4, scale_up_stabilization_seconds=0, scale_down_stabilization_seconds=0,
                       max_step_replicas=100)


def run(role, current, signals, role_spec=ROLE, scaling=FAST, stabilizer=None, now=0.0):
    return decide(role, current, signals, role_spec, scaling, stabilizer or Stabilizer(), now)


def test_ratio_is_ceil_of_current_times_metric_over_target():
    assert ratio_recommendation(2, load=16, target=4, tolerance=0.1) == 4  # 8 per replica, target 4
    assert ratio_recommendation(3, load=15, target=4, tolerance=0.1) == 4  # ceil(3.75)
    assert ratio_recommendation(4, load=16, target=4, tolerance=0.1) == 4
    assert ratio_recommendation(4, load=4, target=4, tolerance=0.1) == 1


def test_within_ten_percent_tolerance_nothing_changes():
    assert ratio_recommendation(4, load=17.2, target=4, tolerance=0.1) == 4  # ratio 1.075
    assert ratio_recommendation(4, load=14.8, target=4, tolerance=0.1) == 4  # ratio 0.925
    assert ratio_recommendation(4, load=18.4, target=4, tolerance=0.1) == 5  # ratio 1.15
    assert ratio_recommendation(4, load=12, target=4, tolerance=0.1) == 3  # ratio 0.75


def test_from_zero_replicas_the_load_alone_decides():
    assert ratio_recommendation(0, load=0, target=4, tolerance=0.1) == 0
    assert ratio_recommendation(0, load=1, target=4, tolerance=0.1) == 1
    assert ratio_recommendation(0, load=9, target=4, tolerance=0.1) == 3


def test_bounds_clamp_the_decision():
    assert run("prefill", 2, Signals(prefill_queue=400)).desired == 10
    assert run("prefill", 5, Signals()).desired == 1  # minReplicas 1: never below


def test_step_cap_limits_one_decision():
    scaling = AutoscalingSpec(target_per_replica=1, scale_down_stabilization_seconds=0, max_step_replicas=3)
    up = run("prefill", 1, Signals(prefill_queue=9), scaling=scaling)
    assert (up.desired, up.recommendation, up.reason) == (4, 9, "StepLimited")
    down = run("prefill", 9, Signals(prefill_queue=1), scaling=scaling)
    assert down.desired == 6


def test_scale_down_waits_for_the_whole_stabilization_window():
    scaling = AutoscalingSpec(target_per_replica=4, scale_down_stabilization_seconds=60, max_step_replicas=100)
    stab = Stabilizer()
    assert run("prefill", 4, Signals(prefill_queue=16), scaling=scaling, stabilizer=stab, now=0).desired == 4
    # Load drops: every recommendation of the last 60 s must agree before replicas go down.
    for t in (10, 30, 59):
        d = run("prefill", 4, Signals(prefill_queue=4), scaling=scaling, stabilizer=stab, now=t)
        assert (d.desired, d.reason) == (4, "StabilizationWindow")
    assert run("prefill", 4, Signals(prefill_queue=4), scaling=scaling, stabilizer=stab, now=61).desired == 1


def test_fresh_autoscaler_waits_a_full_window_before_scaling_down():
    scaling = AutoscalingSpec(target_per_replica=4, scale_down_stabilization_seconds=30, max_step_replicas=100)
    stab = Stabilizer()
    assert run("prefill", 3, Signals(), scaling=scaling, stabilizer=stab, now=100).desired == 3
    assert run("prefill", 3, Signals(), scaling=scaling, stabilizer=stab, now=129).desired == 3
    assert run("prefill", 3, Signals(), scaling=scaling, stabilizer=stab, now=131).desired == 1
    # ... while scaling up at once when the up window is 0.
    assert run("prefill", 1, Signals(prefill_queue=12), scaling=scaling, stabilizer=Stabilizer()).desired == 3


def test_scale_up_stabilization_ignores_a_short_spike():
    scaling = AutoscalingSpec(target_per_replica=4, scale_up_stabilization_seconds=30,
                              scale_down_stabilization_seconds=0, max_step_replicas=100)
    stab = Stabilizer()
    assert run("prefill", 1, Signals(prefill_queue=4), scaling=scaling, stabilizer=stab, now=0).desired == 1
    spike = run("prefill", 1, Signals(prefill_queue=40), scaling=scaling, stabilizer=stab, now=10)
    assert spike.desired == 1  # the t=0 recommendation (1) is still inside the 30 s window
    sustained = [run("prefill", 1, Signals(prefill_queue=40), scaling=scaling, stabilizer=stab, now=t)
                 for t in (20, 29, 31)]
    assert [d.desired for d in sustained] == [1, 1, 10]  # only once the window holds just high values


def test_idle_role_with_min_zero_scales_to_zero_and_wakes_on_queued_work():
    d = run("prefill", 2, Signals(), role_spec=ZERO_ROLE)
    assert (d.desired, d.reason) == (0, "ScaleToZero")
    idle = run("prefill", 0, Signals(), role_spec=ZERO_ROLE)
    assert (idle.desired, idle.reason) == (0, "Idle")
    wake = run("prefill", 0, Signals(prefill_queue=1), role_spec=ZERO_ROLE)
    assert (wake.desired, wake.reason) == (1, "WakeUp")
    assert run("prefill", 0, Signals(prefill_queue=10), role_spec=ZERO_ROLE).desired == 3


def test_min_replicas_one_never_scales_to_zero():
    assert run("decode", 1, Signals(), role_spec=ROLE).desired == 1


def test_decode_stays_up_while_prefill_has_work_and_the_reverse():
    # Decode idle, but prefill has queued requests that will need decode next.
    d = run("decode", 1, Signals(prefill_queue=3), role_spec=ZERO_ROLE)
    assert (d.desired, d.reason) == (1, "PipelineBusy")
    woken = run("decode", 0, Signals(prefill_queue=3), role_spec=ZERO_ROLE)
    assert woken.desired == 1
    # Prefill idle, but decode has queued requests (KV hand-offs in flight need prefill alive).
    assert run("prefill", 1, Signals(decode_queue=2), role_spec=ZERO_ROLE).desired == 1
    assert run("prefill", 0, Signals(decode_queue=2), role_spec=ZERO_ROLE).desired == 1
    # Decode still generating: not idle, even with empty queues.
    assert run("decode", 1, Signals(decode_running=5), role_spec=ZERO_ROLE).desired == 1
    # Prefill may sleep while decode only generates (nothing queued anywhere).
    assert run("prefill", 1, Signals(decode_running=5), role_spec=ZERO_ROLE).desired == 0


def test_decode_scales_up_on_kv_cache_pressure():
    scaling = AutoscalingSpec(target_per_replica=4, kv_cache_usage_target=0.8, scale_down_stabilization_seconds=0)
    d = run("decode", 2, Signals(decode_queue=8, decode_kv_usage=0.95), scaling=scaling)
    assert (d.desired, d.reason) == (3, "KVCacheUsage")  # ceil(2 × 0.95 / 0.8)
    calm = run("decode", 2, Signals(decode_queue=8, decode_kv_usage=0.5), scaling=scaling)
    assert calm.desired == 2


def test_decision_records_metric_per_replica():
    d = run("prefill", 2, Signals(prefill_queue=12))
    assert d.metric_value == 6 and d.target == 4 and d.desired == 3 and d.changes
