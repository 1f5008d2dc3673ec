"""Async scheduling with speculative decoding: steps that may speculate (batches of at most
--speculative-disable-batch-size, or seeded sequences) run synchronously, larger batches overlap,
and every output equals the synchronous speculative engine's (greedy ones the plain engine's)."""

from __future__ import annotations

import pytest
from helpers import PROMPTS, make_engine
from kvrelay.engine.sampling_params import SamplingParams
from test_async_scheduling import _collect_aborting, _same
from test_model_runner import _collect
from test_spec_decode import REPEATING, STORY
from test_spec_decode_draft import _spec, draft  # noqa: F401 - the fixture

from kvrelay.models import BUNDLED_MODEL

DISABLE_AT = 4  # more sequences than this: no speculation, so the steps overlap


def _requests() -> dict[str, tuple]:
    """Ten requests, so the batch starts above DISABLE_AT and ends below it: long greedy ones that
    repeat (lookups hit), stops by string and length, logprobs, and a short seeded one."""
    reqs = {f"g{i}": ((REPEATING + PROMPTS)[i], SamplingParams(max_tokens=30 + 12 * i, temperature=0.0))
            for i in range(6)}
    return reqs | {
        "stop": (STORY, SamplingParams(max_tokens=80, temperature=0.0, stop=["park"])),
        "length": (REPEATING[1], SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True)),
        "logprobs": (REPEATING[0], SamplingParams(max_tokens=50, temperature=0.0, logprobs=2)),
        "seeded": (PROMPTS[2], SamplingParams(max_tokens=8, temperature=0.8, seed=5)),
    }


def _spec_kw(method: str, draft_dir) -> dict:
    if method == "ngram":
        return {"speculative_method": "ngram", "num_speculative_tokens": 4, "ngram_min": 1,
                "speculative_adaptive": False, "speculative_disable_batch_size": DISABLE_AT}
    return _spec(draft_dir, speculative_disable_batch_size=DISABLE_AT)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_small_batches_speculate_large_ones_overlap_with_the_synchronous_outputs(method, draft):  # noqa: F811
    kw = _spec_kw(method, draft)
    sync = _collect(make_engine(BUNDLED_MODEL, **kw), _requests())
    plain = _collect(make_engine(BUNDLED_MODEL), _requests())
    _same(plain, sync, skip={"seeded"})  # lossless; seeded draws as verification draws, not as plain sampling
    engine = make_engine(BUNDLED_MODEL, async_scheduling=True, **kw)
    got = _collect(engine, _requests())
    _same(sync, got)
    assert got[("stop", 0)]["reason"] == "stop" and got[("length", 0)]["reason"] == "length"
    o, s = engine.overlap, engine.speculator.stats
    assert o.overlapped_steps > 5 and o.speculative_steps > 5, (o.overlapped_steps, o.speculative_steps)
    assert o.waited_steps > 0  # an overlapped step was in flight when the batch became small
    assert s.num_drafts > 0 and 0 < s.num_accepted_tokens < s.num_draft_tokens
    assert engine.pool.num_free == engine.pool.num_blocks or engine.args.enable_prefix_caching
    assert not engine.requests and o.in_flight is None


def test_aborts_across_both_kinds_of_step_free_everything():
    kw = _spec_kw("ngram", None) | {"enable_prefix_caching": False}
    sync = _collect(make_engine(BUNDLED_MODEL, **kw), _requests())
    engine = make_engine(BUNDLED_MODEL, async_scheduling=True, **kw)
    aborts = {"g5": 40, "g4": 5, "logprobs": 20}  # late (small batch), early (large), in between
    got = _collect_aborting(engine, _requests(), dict(aborts))
    _same(sync, got, skip=set(aborts))
    for rid in aborts:
        ids = got[(rid, 0)]["ids"]
        assert got[(rid, 0)]["reason"] == "abort" and ids == sync[(rid, 0)]["ids"][: len(ids)], rid
    assert engine.pool.num_free == engine.pool.num_blocks and not engine.requests
    assert engine.overlap.in_flight is None
