"""Structured output in the engine: the bitmask holds through preemption, prefix caching, n > 1 and
speculative decoding, and ends on EOS or by length."""

from __future__ import annotations

import json
import re

from helpers import PROMPTS, make_engine
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.structured.spec import GuidedSpec

from kvrelay.models import BUNDLED_MODEL

REGEX = r"(The|A) (cat|dog|bird) (ran|sat|sang)( and (ran|sat|sang)){0,12}\."
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "w": {"type": "array", "maxItems": 12, "items": {"enum": ["x", "yy"]}}},
          "required": ["n", "w"], "additionalProperties": False}


def _run(engine, requests: dict[str, tuple]) -> dict[str, tuple[str, str]]:
    """id -> (text of sample 0, finish reason)."""
    text: dict[str, list[str]] = {rid: [] for rid in requests}
    reason: dict[str, str] = {}
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, rid)
    while engine.has_work():
        for o in engine.step():
            if o.index == 0:
                text[o.request_id].append(o.text)
                reason[o.request_id] = o.finish_reason or reason.get(o.request_id)
    return {rid: ("".join(t), reason[rid]) for rid, t in text.items()}


def _requests(seed: int = 0) -> dict[str, tuple]:
    out = {}
    for i in range(4):
        spec = GuidedSpec("regex", REGEX) if i % 2 else GuidedSpec("json", json.dumps(SCHEMA))
        out[str(i)] = (PROMPTS[i % len(PROMPTS)], SamplingParams(max_tokens=80, temperature=1.0, seed=seed + i,
                                                                 structured=spec))
    return out


def _check(results: dict[str, tuple[str, str]]) -> None:
    for rid, (text, reason) in results.items():
        assert reason == "stop", (rid, text)
        if int(rid) % 2:
            assert re.fullmatch(REGEX, text), text
        else:
            value = json.loads(text)
            assert set(value) == {"n", "w"} and 0 <= value["n"] <= 999 and set(value["w"]) <= {"x", "yy"}


def test_constraint_survives_preemption_and_equals_a_roomy_run():
    small = make_engine(BUNDLED_MODEL, num_kv_blocks=8, max_model_len=128, max_num_batched_tokens=64)
    tight = _run(small, _requests())
    assert small.stats().num_preemptions > 0
    _check(tight)
    assert tight == _run(make_engine(BUNDLED_MODEL), _requests())
    assert small.pool.num_free == small.pool.num_blocks


def test_prefix_cache_hits_and_n_samples_each_follow_the_grammar():
    engine = make_engine(BUNDLED_MODEL)
    params = SamplingParams(n=4, max_tokens=120, temperature=1.0, seed=5, structured=GuidedSpec("regex", REGEX))
    for rid in ("a", "b"):  # b's prompt is served from the prefix cache
        engine.add_request(PROMPTS[2], params, rid)
    texts: dict[tuple[str, int], str] = {}
    while engine.has_work():
        for o in engine.step():
            texts[o.request_id, o.index] = texts.get((o.request_id, o.index), "") + o.text
    assert engine.stats().prefix_cache_hits > 0
    assert len(texts) == 8 and all(re.fullmatch(REGEX, t) for t in texts.values())
    assert texts["a", 0] == texts["b", 0]  # same seed: the cache does not change the samples


def test_constrained_sequences_speculate_and_follow_the_grammar():
    """Seeded sampling with n-gram speculation: every output still follows its grammar, and the
    constrained sequences speculated (token identity with plain decoding, greedy and mixed with
    free sequences: tests/engine/test_spec_decode_structured.py)."""
    spec = make_engine(BUNDLED_MODEL, speculative_method="ngram", num_speculative_tokens=4, ngram_min=1,
                       speculative_adaptive=False)
    _check(_run(spec, _requests(seed=40)))
    s = spec.speculator.stats
    assert s.num_constrained_drafts > 0 and s.num_constrained_accepted_tokens > 0


def test_cut_by_max_tokens_reports_length():
    engine = make_engine(BUNDLED_MODEL)
    out = _run(engine, {"x": ("Lily", SamplingParams(max_tokens=4, temperature=0.0,
                                                    structured=GuidedSpec("json", json.dumps(SCHEMA))))})
    text, reason = out["x"]
    assert reason == "length" and text.startswith('{"n"')
