"""Overlapping pipeline stages (gloo, real worker processes): with PP=2 two steps are in flight at
once, and every request's tokens, logprobs, text and finish reason equal one process's, with
requests of different lengths arriving over time, seeded sampling, stop strings, prompt logprobs,
preemption, prefix caching and aborts."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from helpers import PROMPTS, make_engine
from kvrelay.engine.parallel.executor import WorkerDiedError
from kvrelay.engine.sampling_params import SamplingParams
from tiny_models import save_tiny_model

from kvrelay.models import BUNDLED_MODEL

KV = {"kv_cache_memory": 4 * 2**20}
PREFIX = "Once upon a time there was a little girl who lived in a village near the forest. "

# (arrival step, prompt, params): greedy and seeded sampling, stop strings, different lengths.
WORKLOAD = [
    (0, PROMPTS[0], SamplingParams(max_tokens=14, temperature=0.0, logprobs=1)),
    (0, PROMPTS[1], SamplingParams(max_tokens=6, temperature=0.8, seed=7, logprobs=0)),
    (0, PREFIX + "She", SamplingParams(max_tokens=20, temperature=0.0, logprobs=0)),
    (2, PROMPTS[2], SamplingParams(max_tokens=9, temperature=1.0, top_p=0.9, seed=3, logprobs=0, n=2)),
    (3, PREFIX + "One day", SamplingParams(max_tokens=17, temperature=0.0, stop=[" the"], logprobs=0)),
    (5, PROMPTS[3], SamplingParams(max_tokens=11, temperature=0.0, logprobs=2, prompt_logprobs=1)),
    (8, PREFIX + "He", SamplingParams(max_tokens=5, temperature=0.7, seed=11, logprobs=0)),
]


def _serve(engine, workload=WORKLOAD) -> dict:
    """Requests added at their arrival step; per (request, sample): tokens, logprobs, text, finish."""
    out: dict = {}
    pending = sorted(enumerate(workload), key=lambda x: x[1][0])
    steps = 0
    while pending or engine.has_work():
        while pending and pending[0][1][0] <= steps:
            i, (_, prompt, params) = pending.pop(0)
            engine.add_request(prompt, params, str(i))
        for o in engine.step():
            r = out.setdefault((o.request_id, o.index), {"tokens": [], "lps": [], "text": "", "finish": None})
            r["tokens"].extend(o.new_token_ids)
            r["lps"].extend(lp.logprob for lp in o.logprobs or [])
            r["text"] += o.text
            r["finish"] = o.finish_reason or r["finish"]
            r["lps"].extend(lp.logprob for lp in o.prompt_logprobs or [] if lp is not None)
        steps += 1
    return out


def _assert_same(ref: dict, got: dict, atol: float = 1e-4) -> None:
    assert got.keys() == ref.keys()
    for key in ref:
        assert got[key]["tokens"] == ref[key]["tokens"], key
        assert got[key]["text"] == ref[key]["text"], key
        assert got[key]["finish"] == ref[key]["finish"], key
        assert torch.allclose(
            torch.tensor(got[key]["lps"]), torch.tensor(ref[key]["lps"]), atol=atol, rtol=0
        ), (key, (torch.tensor(got[key]["lps"]) - torch.tensor(ref[key]["lps"])).abs().max())


@pytest.fixture(scope="module")
def stories_ref():
    out = _serve(make_engine(BUNDLED_MODEL, **KV))
    assert any(r["finish"] == "stop" for r in out.values())  # the stop string ends one request
    assert len(out[("5", 0)]["lps"]) > 11  # prompt logprobs came too
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_overlapped_stages_match_one_process(stories_ref, tp):
    engine = make_engine(
        BUNDLED_MODEL, tensor_parallel_size=tp, pipeline_parallel_size=2, pipeline_overlap=True, **KV
    )
    try:
        assert engine.pipeline is not None
        got = _serve(engine)
        assert engine.executor.max_in_flight == 2  # the two stages held two groups' steps at once
        assert engine.executor.in_flight == 0 and not engine.pipeline.in_flight
        assert engine.stats().prefix_cache_hits > 0
        # The last stage sampled the rows of steps without prompt logprobs (remote_sampling.py).
        assert engine.executor.sampled_rows > sum(len(r["tokens"]) for r in got.values()) // 2
    finally:
        engine.close()
    _assert_same(stories_ref, got)


def test_random_tiny_qwen3_tp2_pp2_overlapped_matches_one_process(tmp_path):
    """q/k norm and 3 layers over 2 stages (stage 0 takes 2), four processes, requests over time."""
    model = save_tiny_model(tmp_path / "qwen3", "qwen3", num_hidden_layers=3)
    ref = _serve(make_engine(model, **KV))
    engine = make_engine(model, tensor_parallel_size=2, pipeline_parallel_size=2, pipeline_overlap=True, **KV)
    try:
        got = _serve(engine)
        assert engine.executor.max_in_flight == 2
    finally:
        engine.close()
    _assert_same(ref, got)


@pytest.mark.parametrize("async_output", [False, True], ids=["outputs_at_once", "deferred_outputs"])
def test_two_steps_are_in_flight_before_the_first_is_sampled(async_output):
    engine = make_engine(BUNDLED_MODEL, pipeline_parallel_size=2, pipeline_overlap=True, async_output=async_output,
                         **KV)
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0)
        engine.add_request(PROMPTS[0], params, "a")
        engine.add_request(PROMPTS[1], params, "b")
        assert engine.step() == []  # group 0 submitted; nothing collected yet
        assert engine.executor.in_flight == 1
        first = engine.pipeline.in_flight[0].step.seqs
        outs = engine.step()  # group 1 submitted while group 0 runs, then group 0 collected
        assert engine.executor.max_in_flight == 2
        second = engine.pipeline.in_flight[0].step.seqs
        assert [s.request_id for s in first] == ["a"] and [s.request_id for s in second] == ["b"]
        if async_output is False:
            assert [o.request_id for o in outs] == ["a"]
        else:  # the default on CUDA: group 0's text is made in the next step, while group 1 is out
            assert outs == []
            assert [o.request_id for o in engine.step()] == ["a"] and engine.executor.in_flight == 1
    finally:
        engine.close()


def test_without_overlap_one_step_is_in_flight(stories_ref):
    engine = make_engine(BUNDLED_MODEL, pipeline_parallel_size=2, **KV)  # the default on CPU
    try:
        assert engine.pipeline is None
        _assert_same(stories_ref, _serve(engine))
        assert engine.executor.max_in_flight == 1  # sent, the last step's text made meanwhile, collected
    finally:
        engine.close()


def test_preemption_under_overlap_matches_one_process(tmp_path):
    """A random tiny Llama, a KV cache of 10 blocks: sequences of both groups are preempted and
    recomputed, and a group preempts only its own sequences."""
    model = save_tiny_model(tmp_path / "llama", "llama", num_hidden_layers=4)
    small = {"num_kv_blocks": 10, "block_size": 16, "max_model_len": 128}
    workload = [
        (
            k % 3,
            PROMPTS[k % 4] + " and" * k,
            SamplingParams(max_tokens=30 + 3 * k, temperature=0.0, ignore_eos=True, logprobs=0),
        )
        for k in range(6)
    ]
    ref_engine = make_engine(model, **small)
    ref = _serve(ref_engine, workload)
    assert ref_engine.stats().num_preemptions > 0
    for tp in (1, 2):
        engine = make_engine(
            model, tensor_parallel_size=tp, pipeline_parallel_size=2, pipeline_overlap=True, **small
        )
        try:
            got = _serve(engine, workload)
            assert engine.stats().num_preemptions > 0
            assert engine.executor.max_in_flight == 2
        finally:
            engine.close()
        # The engines preempt at different steps, so recomputed K/V come from prefills of other shapes
        # than the decodes that first wrote them: fp32 sums in another order (1e-4 on longer sequences).
        _assert_same(ref, got, atol=5e-4)


def test_killed_worker_fails_the_overlapped_engine_without_hanging():
    engine = make_engine(BUNDLED_MODEL, pipeline_parallel_size=2, pipeline_overlap=True, **KV)
    try:
        for i in range(2):
            engine.add_request(PROMPTS[i], SamplingParams(max_tokens=400, temperature=0.0), str(i))
        engine.step()
        engine.step()
        os.kill(engine.executor.pids[0], signal.SIGKILL)  # the first stage, with a step in flight
        deadline = time.monotonic() + 30
        with pytest.raises(WorkerDiedError, match=r"rank 0 .*exit code -9"):
            while time.monotonic() < deadline:
                engine.step()
        assert time.monotonic() < deadline
        assert engine.has_work()
    finally:
        engine.close()


def test_abort_of_a_request_in_flight(stories_ref):
    """An aborted request's step is still collected (its row dropped, its blocks already reused by
    the next step in the order the workers run them); the other requests are unaffected."""
    engine = make_engine(BUNDLED_MODEL, pipeline_parallel_size=2, pipeline_overlap=True, **KV)
    try:
        _, prompt, params = WORKLOAD[0]
        engine.add_request(prompt, params, "0")
        engine.add_request(PROMPTS[1], SamplingParams(max_tokens=50, temperature=0.0), "x")
        outs = engine.step() + engine.step()
        assert [f.step.seqs[0].request_id for f in engine.pipeline.in_flight] == ["x"]
        assert engine.abort("x")[0].finish_reason == "abort"
        tokens, lps = [], []
        while engine.has_work():
            outs += engine.step()
        for o in outs:
            assert o.request_id == "0"
            tokens += o.new_token_ids
            lps += [lp.logprob for lp in o.logprobs]
        assert tokens == stories_ref[("0", 0)]["tokens"]
        assert torch.allclose(
            torch.tensor(lps), torch.tensor(stories_ref[("0", 0)]["lps"]), atol=1e-4, rtol=0
        )
        assert engine.executor.in_flight == 0
        assert engine.pool.num_free == engine.pool.num_blocks  # nothing leaked
    finally:
        engine.close()
