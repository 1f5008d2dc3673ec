"""Host work overlapped with tensor-parallel workers (gloo, real worker processes): the driver turns
step N's tokens into outputs while the workers compute step N+1, with deferred outputs (the default
with CUDA workers) and with --async-scheduling, and every output equals one synchronous process's."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest
from helpers import PROMPTS, make_engine
from kvrelay.engine.parallel.executor import WorkerDiedError
from kvrelay.engine.sampling_params import SamplingParams
from test_async_scheduling import _requests, _same
from test_model_runner import _collect
from test_spec_decode import REPEATING, SPEC

from kvrelay.models import BUNDLED_MODEL

KV = {"kv_cache_memory": 4 * 2**20}


def _tp_requests() -> dict[str, tuple]:
    """test_async_scheduling's requests, and a logit bias without penalties: the parallel worker
    samples it, with its bias (and min_tokens' ban) applied there."""
    return _requests() | {
        "bias": (PROMPTS[1], SamplingParams(max_tokens=30, temperature=0.7, seed=4, logit_bias={426: -8.0, 263: 3.0})),
        # Unbanned, this greedy run stops at "." (426) after 4 tokens.
        "ban": (PROMPTS[5], SamplingParams(max_tokens=20, temperature=0.0, min_tokens=10, stop_token_ids=[426])),
        # The bias makes "." likely, each one the penalties count pushes it back: which tokens come
        # depends on counting the last one too (under async scheduling, the token in flight).
        "recount": (PROMPTS[2], SamplingParams(max_tokens=24, temperature=0.0, logit_bias={426: 10.0},
                                                frequency_penalty=1.5, presence_penalty=1.0)),
    }


@pytest.fixture(scope="module")
def sync_ref():
    out = _collect(make_engine(BUNDLED_MODEL, **KV), _tp_requests())
    unbiased = _collect(make_engine(BUNDLED_MODEL, **KV), {"bias": (PROMPTS[1], SamplingParams(
        max_tokens=30, temperature=0.7, seed=4))})
    assert out[("bias", 0)]["ids"] != unbiased[("bias", 0)]["ids"]  # the bias changes the tokens
    # So do the penalties, which the worker applies too (the driver's history sent with the row).
    requests = _requests()
    unpenalised = _collect(make_engine(BUNDLED_MODEL, **KV), {
        k: (requests[k][0], dataclasses.replace(requests[k][1], repetition_penalty=1.0, frequency_penalty=0.0,
                                                presence_penalty=0.0)) for k in ("penalised", "frequency")})
    for k in ("penalised", "frequency"):
        assert out[(k, 0)]["ids"] != unpenalised[(k, 0)]["ids"], k
    assert len(out[("ban", 0)]["ids"]) >= 10
    return out


def _watch_in_flight(engine, name: str) -> list[int]:
    """Wraps engine's (or its overlap's) method `name`: each call records how many steps the
    executor had sent and not yet answered, and the call's number of outputs."""
    owner = engine.overlap if engine.overlap is not None else engine
    inner = getattr(owner, name)
    seen: list[tuple[int, int]] = []

    def watched(*a, **kw):
        out = inner(*a, **kw)
        seen.append((engine.executor.in_flight, len(out)))
        return out

    setattr(owner, name, watched)
    return seen


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["deferred_outputs", "async_scheduling"])
def test_outputs_are_made_while_the_workers_compute_and_equal_one_process(sync_ref, async_scheduling):
    engine = make_engine(BUNDLED_MODEL, tensor_parallel_size=2, async_scheduling=async_scheduling,
                         async_output=True, **KV)  # the default with CUDA workers
    try:
        seen = _watch_in_flight(engine, "_collect" if async_scheduling else "_flush_deferred")
        got = _collect(engine, _tp_requests())
        _same(sync_ref, got)
        # The host's share of the outputs came while a step was out with the workers: all of it
        # but the last, which has no next step to hide behind.
        busy = [n for in_flight, n in seen if n and in_flight == 1]
        idle = [n for in_flight, n in seen if n and in_flight == 0]
        assert len(busy) > 20 and len(idle) <= 2, (len(busy), idle)
        # Most rows were sampled on the worker (remote_sampling.py), the penalties (with async
        # scheduling counting the token in flight, from the driver's copy), min_tokens' ban and the
        # bias applied there; grammars on the driver; all as one process's.
        host_rows = {("grammar", 0), ("grammar", 1)}
        assert engine.executor.sampled_rows >= sum(len(v["ids"]) for k, v in got.items() if k not in host_rows)
        if async_scheduling:
            assert engine.overlap.late_sampled_steps == engine.overlap.overlapped_steps > 20
            assert engine.overlap.in_flight is None
        assert not engine.requests and engine.executor.in_flight == 0
    finally:
        engine.close()


def test_async_scheduling_under_tp_preempts_and_aborts_with_the_synchronous_outputs():
    """A cache too small for the batch (recompute preemption) and aborts mid-flight: the outputs
    are one synchronous process's, the aborted ones a prefix of them, and every block comes back."""
    kw = {"num_kv_blocks": 33, "enable_prefix_caching": False}
    requests = _requests() | {f"more{i}": (PROMPTS[i], SamplingParams(max_tokens=150, temperature=0.8, seed=i))
                              for i in range(4)}
    aborts = {"greedy": 4, "top_p": 10}
    sync = _collect(make_engine(BUNDLED_MODEL, **kw), requests)
    engine = make_engine(BUNDLED_MODEL, tensor_parallel_size=2, async_scheduling=True, **kw)
    try:
        got = _collect(engine, requests, dict(aborts))
        _same(sync, got, skip=set(aborts))
        for rid in aborts:
            ids = got[(rid, 0)]["ids"]
            assert got[(rid, 0)]["reason"] == "abort" and ids == sync[(rid, 0)]["ids"][: len(ids)], rid
        assert engine.scheduler.num_preemptions > 0
        assert engine.pool.num_free == engine.pool.num_blocks and not engine.requests
    finally:
        engine.close()


def test_a_worker_killed_while_the_driver_makes_outputs_fails_the_engine():
    """The kill lands while a step is out with the workers: the step raises WorkerDiedError (the
    reply is still awaited after the host's work, on every worker's sentinel) instead of hanging."""
    engine = make_engine(BUNDLED_MODEL, tensor_parallel_size=2, async_scheduling=True, **KV)
    try:
        engine.add_request("Once upon a time", SamplingParams(max_tokens=400, temperature=0.0), "r")
        killed = []
        collect = engine.overlap._collect

        def kill_then_collect(prev):
            if not killed and engine.executor.in_flight == 1:
                os.kill(engine.executor.pids[1], signal.SIGKILL)
                killed.append(True)
            return collect(prev)

        engine.overlap._collect = kill_then_collect
        deadline = time.monotonic() + 60
        with pytest.raises(WorkerDiedError, match=r"rank 1 .*exit code -9"):
            while time.monotonic() < deadline:
                engine.step()
        assert killed and time.monotonic() < deadline
    finally:
        engine.close()


@pytest.mark.parametrize("engine_kw", [{"async_output": True}, {"tensor_parallel_size": 2, "async_output": True}],
                         ids=["deferred_in_one_process", "tp2"])
def test_speculation_with_deferred_outputs_ends_where_plain_decoding_does(engine_kw):
    """Deferred outputs find a stop string one step late, after the next step's drafts went out:
    the drafts are withdrawn and the request ends where undeferred speculation (and, greedy, plain
    decoding) ends it, with its text."""
    requests = {
        "stop": (REPEATING[0], SamplingParams(max_tokens=60, temperature=0.0, stop=["park"])),
        "length": (REPEATING[1], SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True)),
        "greedy": (REPEATING[1], SamplingParams(max_tokens=40, temperature=0.0)),
        "seeded": (REPEATING[0], SamplingParams(max_tokens=30, temperature=0.8, seed=11)),
    }
    want = _collect(make_engine(BUNDLED_MODEL, **SPEC, async_output=False, **KV), requests)
    plain = _collect(make_engine(BUNDLED_MODEL, **KV), requests)
    _same(plain, want, skip={"seeded"})  # seeded: the verification's draws, not plain sampling's
    assert want[("stop", 0)]["reason"] == "stop" and want[("length", 0)]["reason"] == "length"
    engine = make_engine(BUNDLED_MODEL, **SPEC, **engine_kw, **KV)
    try:
        assert engine.defer_outputs
        got = _collect(engine, requests)
        _same(want, got)
        s = engine.speculator.stats
        assert s.num_drafts > 0 and 0 < s.num_accepted_tokens < s.num_draft_tokens
        assert not engine.requests
    finally:
        engine.close()


def test_async_scheduling_refuses_overlapping_pipeline_stages():
    with pytest.raises(ValueError, match="--async-scheduling does not combine with --pipeline-parallel-size"):
        make_engine(BUNDLED_MODEL, pipeline_parallel_size=2, async_scheduling=True, **KV)
