"""Async scheduling: step N+1 is launched before step N's tokens are read, with the same outputs."""

from __future__ import annotations

import argparse
import itertools

import pytest
import torch
from helpers import PROMPTS, make_engine
from kvrelay.engine.async_scheduling import PENDING
from kvrelay.engine.engine_args import EngineArgs
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.structured.spec import GuidedSpec
from test_model_runner import _collect

from kvrelay.models import BUNDLED_MODEL


def _requests() -> dict[str, tuple]:
    """Every kind of sequence: greedy, seeded, filtered, stops by string, id and length, n > 1,
    logprobs, min_tokens, penalties (counting the token in flight on the device) and a grammar (whose
    steps wait for the tokens)."""
    return {
        "greedy": (PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0)),
        "stop_string": (PROMPTS[2], SamplingParams(max_tokens=60, temperature=0.0, stop=[" the", "."])),
        "seeded_n3": (PROMPTS[3], SamplingParams(max_tokens=30, temperature=0.9, seed=7, n=3, top_k=20)),
        "top_p": (PROMPTS[1], SamplingParams(max_tokens=45, temperature=0.8, seed=11, top_p=0.9, min_p=0.02)),
        "stop_id": (PROMPTS[1], SamplingParams(max_tokens=50, temperature=0.7, seed=3, stop_token_ids=[426])),  # "." here
        "long": (PROMPTS[0], SamplingParams(max_tokens=300, temperature=0.0)),
        "logprobs": (PROMPTS[5], SamplingParams(max_tokens=20, temperature=0.9, seed=5, logprobs=3)),
        "min_tokens": (PROMPTS[4], SamplingParams(max_tokens=20, temperature=0.0, min_tokens=8,
                                                  stop_token_ids=[426])),  # "." here
        "penalised": (PROMPTS[5], SamplingParams(max_tokens=25, temperature=0.0, repetition_penalty=1.3)),
        "frequency": (PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.8, seed=9, frequency_penalty=0.7,
                                                 presence_penalty=0.4, logit_bias={426: -2.0})),
        "grammar": (PROMPTS[3], SamplingParams(max_tokens=40, temperature=1.0, seed=2, n=2, structured=GuidedSpec(
            "regex", r"(The|A) (cat|dog|bird) (ran|sat|sang)( and (ran|sat|sang)){0,12}\."))),
        "short": (PROMPTS[4], SamplingParams(max_tokens=1, temperature=0.0)),
        "two": (PROMPTS[2], SamplingParams(max_tokens=2, temperature=0.5, seed=1)),
    }


def _same(sync: dict, overlapped: dict, skip=()) -> None:
    assert overlapped.keys() == sync.keys()
    for key, want in sync.items():
        if key[0] in skip:
            continue
        got = overlapped[key]
        assert {k: got[k] for k in ("ids", "text", "reason")} == {k: want[k] for k in ("ids", "text", "reason")}, key
        # A stopped sequence computes one more (dropped) row, so batches differ: float sums too.
        assert got["lps"] == pytest.approx(want["lps"], abs=1e-4), key


@pytest.mark.parametrize("engine_kw", [
    {},
    {"max_num_batched_tokens": 24},  # chunked prefills beside overlapped decodes
    {"num_kv_blocks": 33, "enable_prefix_caching": False},  # preemption (recompute) mid-flight
    {"num_kv_blocks": 33, "scheduling_policy": "priority"},
], ids=["plain", "chunked", "preempting", "priority"])
def test_async_scheduling_gives_the_synchronous_outputs(engine_kw):
    results, engines = [], []
    for overlapped in (False, True):
        engine = make_engine(BUNDLED_MODEL, async_scheduling=overlapped, **engine_kw)
        requests = _requests()
        if "num_kv_blocks" in engine_kw:  # more than the cache holds at once
            requests |= {f"more{i}": (PROMPTS[i], SamplingParams(max_tokens=150, temperature=0.8, seed=i))
                         for i in range(4)}
        results.append(_collect(engine, requests))
        engines.append(engine)
        assert not engine.requests
        assert engine.overlap is None if not overlapped else engine.overlap.in_flight is None
        if not engine.args.enable_prefix_caching:
            assert engine.pool.num_free == engine.pool.num_blocks
    _same(*results)
    sync, overlapped = results
    assert sync[("stop_string", 0)]["reason"] == "stop" and sync[("stop_id", 0)]["reason"] == "stop"
    assert sync[("short", 0)]["reason"] == "length" and len(sync[("short", 0)]["ids"]) == 1
    assert sync[("grammar", 1)]["text"].endswith(".") and sync[("grammar", 1)]["reason"] == "stop"
    assert engines[0].generation_tokens_total == engines[1].generation_tokens_total
    if "num_kv_blocks" in engine_kw:
        assert engines[1].scheduler.num_preemptions > 0


def test_the_engine_runs_one_step_ahead_of_its_tokens():
    """The step that launches a decode returns the tokens of the step before it: the decode's input
    is that step's sample, still PENDING on the host, read on the device."""
    engine = make_engine(BUNDLED_MODEL, async_scheduling=True)
    (seq,) = engine.add_request(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0.0), "r")
    assert engine.step() == []  # the prefill is launched; its token not read yet
    assert seq.token_ids[-1] == PENDING and seq.num_computed == seq.prompt_len
    first = engine.step()  # the first decode is launched, then the prefill's token comes out
    assert [len(o.new_token_ids) for o in first] == [1]
    assert seq.token_ids[-2] == first[0].new_token_ids[0] and seq.token_ids[-1] == PENDING
    assert seq.num_computed == seq.prompt_len + 1
    ids = list(first[0].new_token_ids)
    while engine.has_work():
        for o in engine.step():
            ids += o.new_token_ids
            assert PENDING not in seq.token_ids or not o.finished
    assert PENDING not in seq.token_ids and seq.output_ids == ids and len(ids) == 5
    ref = make_engine(BUNDLED_MODEL)
    ref.add_request(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0.0), "r")
    want = []
    while ref.has_work():
        want += [t for o in ref.step() for t in o.new_token_ids]
    assert ids == want


PENALTIES = {
    "repetition": SamplingParams(max_tokens=30, temperature=0.0, repetition_penalty=1.5, ignore_eos=True),
    "presence_frequency": SamplingParams(max_tokens=30, temperature=0.9, seed=4, presence_penalty=2.0, ignore_eos=True,
                                         frequency_penalty=2.0),
}


@pytest.mark.parametrize("name", PENALTIES)
def test_penalised_sequences_overlap_and_count_the_token_in_flight(name):
    """A penalty needs every earlier token, the last one still on the device: it is counted there,
    so steps overlap (no step waits), and the tokens are the synchronous engine's."""
    params = PENALTIES[name]
    results = []
    for overlapped in (False, True):
        engine = make_engine(BUNDLED_MODEL, async_scheduling=overlapped)
        results.append(_collect(engine, {f"r{i}": (PROMPTS[i], params) for i in range(3)}))
        if overlapped:
            assert engine.overlap.waited_steps == 0 and engine.overlap.overlapped_steps >= params.max_tokens - 1
    _same(*results)
    ids = results[0][("r0", 0)]["ids"]
    plain = _collect(make_engine(BUNDLED_MODEL), {"r0": (PROMPTS[0], SamplingParams(
        max_tokens=30, temperature=params.temperature, seed=params.seed, ignore_eos=True))})[("r0", 0)]["ids"]
    assert ids != plain  # the penalty did change what was sampled
    if name == "repetition":  # stories260K greedy repeats itself within 30 tokens; penalised it repeats less
        assert len(set(ids)) > len(set(plain))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_logprobs_and_prompt_logprobs_overlap_and_match_the_synchronous_ones(device):
    """Logprobs (chosen and top-k) and prompt logprobs are computed on the device at launch and come
    back with the tokens: no step waits for them, and every value is the synchronous engine's. On
    CUDA the copies are non-blocking into pinned memory, read after the step's event."""
    cuda = {"device": "cuda", "kv_cache_memory": 64 * 2**20, "max_num_seqs": 16} if device == "cuda" else {}
    requests = {
        "lp": (PROMPTS[0], SamplingParams(max_tokens=24, temperature=0.0, logprobs=5, ignore_eos=True)),
        "lp0": (PROMPTS[1], SamplingParams(max_tokens=24, temperature=0.9, seed=3, logprobs=0, ignore_eos=True)),
        "prompt": (PROMPTS[2], SamplingParams(max_tokens=24, temperature=0.0, prompt_logprobs=3, ignore_eos=True)),
        "plain": (PROMPTS[3], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)),
    }
    results = []
    for overlapped in (False, True):
        engine = make_engine(BUNDLED_MODEL, async_scheduling=overlapped, max_num_batched_tokens=24, **cuda)
        for rid, (prompt, params) in requests.items():
            engine.add_request(prompt, params, rid)
        got: dict[str, dict] = {}
        while engine.has_work():
            for o in engine.step():
                rec = got.setdefault(o.request_id, {"ids": [], "lps": [], "prompt": None})
                rec["ids"] += o.new_token_ids
                rec["lps"] += [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs or []]
                if o.prompt_logprobs is not None:
                    rec["prompt"] = [None if lp is None else (lp.token_id, lp.logprob, lp.top)
                                     for lp in o.prompt_logprobs]
        results.append(got)
        if overlapped:
            assert engine.overlap.waited_steps == 0 and engine.overlap.overlapped_steps > 24
    sync, overlapped = results
    assert overlapped == sync
    assert [len(top) for _, _, top in sync["lp"]["lps"]] == [5] * 24
    assert [top for _, _, top in sync["lp0"]["lps"]] == [[]] * 24
    assert all(token == top[0][0] and value == top[0][1] for token, value, top in sync["lp"]["lps"])  # greedy
    prompt = sync["prompt"]["prompt"]
    assert prompt[0] is None and len(prompt) > 24  # chunks of 24 tokens: scored across several steps
    assert all(len(top) == 3 and top[0][1] >= value for _, value, top in prompt[1:])
    assert sync["plain"]["lps"] == [] and sync["plain"]["prompt"] is None


def test_grammars_and_logits_processors_sample_late_with_the_synchronous_outputs():
    """Sequences whose sampling reads their history on the host no longer make steps wait: each
    step's forward is launched before the previous step's tokens are read, and it samples after
    them. The processor bans repeating the last token, so a sample that missed it would differ."""
    def no_repeat(output_ids: list[int], logits: torch.Tensor) -> None:
        if output_ids:
            logits[output_ids[-1]] = float("-inf")

    requests = {
        "grammar": (PROMPTS[3], SamplingParams(max_tokens=30, temperature=1.0, seed=2, n=2, structured=GuidedSpec(
            "regex", r"(The|A) (cat|dog) (ran|sat)( and (ran|sat)){0,12}\."))),
        "processed": (PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.0)),
        "plain": (PROMPTS[1], SamplingParams(max_tokens=30, temperature=0.8, seed=4, repetition_penalty=1.2)),
    }
    results = []
    for overlapped in (False, True):
        engine = make_engine(BUNDLED_MODEL, async_scheduling=overlapped)
        for rid, (prompt, params) in requests.items():
            engine.add_request(prompt, params, rid)
        engine.requests["processed"][0].processors = [no_repeat]
        out: dict[tuple, list[int]] = {}
        while engine.has_work():
            for o in engine.step():
                out.setdefault((o.request_id, o.index), []).extend(o.new_token_ids)
        results.append(out)
        if overlapped:
            assert engine.overlap.waited_steps == 0 and engine.overlap.late_sampled_steps >= 25
        assert not engine.requests
    sync, overlapped = results
    assert overlapped == sync
    ids = sync[("processed", 0)]
    assert len(ids) == 30 and all(a != b for a, b in itertools.pairwise(ids))


def test_a_late_sampled_step_whose_every_row_finished_meanwhile_samples_nothing():
    """One grammar request alone: its last step's forward was launched before the token that ended
    it was read, so the late sample has no row left (it crashed on an empty index before)."""
    outs = []
    for overlapped in (False, True):
        engine = make_engine(BUNDLED_MODEL, async_scheduling=overlapped)
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=30, temperature=0.0,
                                                      structured=GuidedSpec("regex", "[0-9]{3}")), "r")
        ids, reason = [], None
        while engine.has_work():
            for o in engine.step():
                ids += o.new_token_ids
                reason = o.finish_reason or reason
        outs.append((ids, reason))
        assert engine.pool.num_free == engine.pool.num_blocks
    assert outs[1] == outs[0] and outs[0][1] == "stop"


def test_aborts_mid_flight_free_everything_and_leave_the_others_alone():
    engine_kw = {"enable_prefix_caching": False}
    sync = _collect(make_engine(BUNDLED_MODEL, **engine_kw), _requests())
    engine = make_engine(BUNDLED_MODEL, async_scheduling=True, **engine_kw)
    got = _collect_aborting(engine, _requests(), {"greedy": 4, "seeded_n3": 3, "long": 10})
    _same(sync, got, skip={"greedy", "seeded_n3", "long"})
    for key in [("greedy", 0), ("seeded_n3", 0), ("seeded_n3", 1), ("seeded_n3", 2), ("long", 0)]:
        ids = got[key]["ids"]
        assert got[key]["reason"] == "abort" and ids == sync[key]["ids"][: len(ids)], key
    assert engine.pool.num_free == engine.pool.num_blocks and not engine.requests
    # What was aborted holds no PENDING entry, and nothing still in flight refers to it.
    assert engine.overlap.in_flight is None


def _collect_aborting(engine, requests: dict[str, tuple], abort_after: dict[str, int]) -> dict:
    """Like _collect, with each abort between steps (as AsyncEngine aborts), once sample 0 of the
    request has that many tokens."""
    out: dict[tuple, dict] = {}

    def record(o):
        rec = out.setdefault((o.request_id, o.index), {"ids": [], "text": "", "reason": None, "lps": []})
        rec["ids"] += o.new_token_ids
        rec["text"] += o.text
        rec["lps"] += [lp.logprob for lp in o.logprobs or []]
        rec["reason"] = o.finish_reason

    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, rid)
    while engine.has_work():
        for o in engine.step():
            record(o)
        for rid, n in list(abort_after.items()):
            if len(out.get((rid, 0), {"ids": []})["ids"]) >= n:
                del abort_after[rid]
                for o in engine.abort(rid):
                    record(o)
    return out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_async_scheduling_on_cuda_graphs_gives_the_synchronous_outputs():  # pragma: no cover - CUDA only
    """The overlap for real: launches return at once, step N+1's input ids come from step N's
    samples on the device, and the tokens come back through pinned memory."""
    results, engines = [], []
    for overlapped in (False, True):
        engine = make_engine(BUNDLED_MODEL, device="cuda", kv_cache_memory=64 * 2**20, max_num_seqs=16,
                             async_scheduling=overlapped)
        results.append(_collect(engine, _requests()))
        engines.append(engine)
    _same(*results)
    assert engines[1].runner.graph_steps > 0
    assert engines[1].pool.num_free == engines[1].pool.num_blocks or engines[1].args.enable_prefix_caching


def test_async_scheduling_is_a_flag_that_combines_with_speculation():
    engine = make_engine(BUNDLED_MODEL, async_scheduling=True, speculative_method="ngram")
    assert engine.overlap is not None and engine.speculator is not None  # test_async_scheduling_spec.py
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli(parser.parse_args(["--async-scheduling"])).async_scheduling
    assert not EngineArgs.from_cli(parser.parse_args([])).async_scheduling
