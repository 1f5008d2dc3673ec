"""Scheduling: token budget, max_num_seqs, preemption without loss, priority, abort frees at once."""

from __future__ import annotations

from helpers import PROMPTS, greedy, make_engine, run_engine
from kvrelay.engine.sampling_params import SamplingParams

from kvrelay.models import BUNDLED_MODEL


def test_token_budget_and_max_num_seqs_are_respected():
    engine = make_engine(BUNDLED_MODEL, max_num_batched_tokens=10, max_num_seqs=3)
    steps = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        step = schedule()
        steps.append((sum(step.num_new), len(engine.scheduler.running)))
        return step

    engine.scheduler.schedule = recording_schedule
    out = run_engine(engine, {str(i): (PROMPTS[i], greedy(5)) for i in range(6)})
    assert all(len(v) == 5 for v in out.values())
    assert max(tokens for tokens, _ in steps) == 10  # the budget is used up, never exceeded
    assert max(running for _, running in steps) == 3


def test_preemption_loses_no_request_and_frees_everything():
    engine = make_engine(BUNDLED_MODEL, num_kv_blocks=34, max_model_len=256)
    requests = {str(i): (PROMPTS[i % len(PROMPTS)], greedy(100)) for i in range(10)}
    out = run_engine(engine, requests)
    assert engine.stats().num_preemptions > 0
    assert all(len(v) == 100 for v in out.values())
    assert engine.pool.num_free == engine.pool.num_blocks
    # Same answers as with a roomy pool.
    assert out == run_engine(make_engine(BUNDLED_MODEL), requests)


def test_priority_policy_runs_high_priority_first_and_preempts_low():
    engine = make_engine(BUNDLED_MODEL, scheduling_policy="priority", max_num_seqs=1)
    engine.add_request("Lily", greedy(30), "low", priority=0)
    engine.step()
    engine.add_request("Tom", greedy(5), "high", priority=10)
    order = []
    while engine.has_work():
        for o in engine.step():
            if o.finish_reason:
                order.append(o.request_id)
    assert order == ["high", "low"]


def test_priority_preemption_when_blocks_run_out():
    engine = make_engine(BUNDLED_MODEL, scheduling_policy="priority", num_kv_blocks=33, max_model_len=512)
    engine.add_request([5] * 500, SamplingParams(max_tokens=12, temperature=0), "low", priority=0)
    for _ in range(3):
        engine.step()
    engine.add_request([7] * 400, SamplingParams(max_tokens=4, temperature=0), "high", priority=5)
    finished = []
    while engine.has_work():
        finished += [o.request_id for o in engine.step() if o.finish_reason]
    assert finished == ["high", "low"]
    assert engine.stats().num_preemptions >= 1


def test_fcfs_admits_in_arrival_order():
    engine = make_engine(BUNDLED_MODEL, max_num_seqs=1)
    for i in range(3):
        engine.add_request("Lily", greedy(3), str(i), priority=i)
    finished = []
    while engine.has_work():
        finished += [o.request_id for o in engine.step() if o.finish_reason]
    assert finished == ["0", "1", "2"]


def test_abort_frees_blocks_at_once():
    engine = make_engine(BUNDLED_MODEL)
    engine.add_request(PROMPTS[5], SamplingParams(max_tokens=100, temperature=0), "a")
    engine.add_request(PROMPTS[2], SamplingParams(max_tokens=100, temperature=0), "w")
    for _ in range(3):
        engine.step()
    assert engine.pool.num_free < engine.pool.num_blocks
    outs = engine.abort("a") + engine.abort("w")
    assert [o.finish_reason for o in outs] == ["abort", "abort"]
    assert engine.pool.num_free == engine.pool.num_blocks and not engine.has_work()
    assert engine.abort("unknown") == []
