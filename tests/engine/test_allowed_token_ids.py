"""allowed_token_ids (vLLM's): sampling only among a set of ids. Greedy equals transformers' argmax
over the set at every step; speculative decoding and the wire keep it."""

from __future__ import annotations

import pytest
import torch
from helpers import _hf_model, make_engine, run_engine
from kvrelay.engine.errors import InvalidRequestError
from kvrelay.engine.parallel.remote_sampling import plan
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.convert import params_from_proto, params_to_proto

from kvrelay.models import BUNDLED_MODEL

PROMPT = "Once upon a time, there was a little girl named Lily. She loved"
ALLOWED = [261, 278, 285, 300, 337, 403, 426]  # a few ordinary tokens; the free greedy text has others too


def _reference(prompt_ids: list[int], n: int) -> list[int]:
    """transformers' greedy, restricted to ALLOWED at every step."""
    model, ids = _hf_model(str(BUNDLED_MODEL)), list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(ALLOWED[int(logits[ALLOWED].argmax())])
    return ids[len(prompt_ids):]


def test_greedy_among_the_allowed_ids_equals_transformers():
    engine = make_engine(BUNDLED_MODEL)
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0, allowed_token_ids=ALLOWED)
    free = run_engine(engine, {"f": (PROMPT, SamplingParams(max_tokens=12, temperature=0.0))})["f"]
    assert not set(free) <= set(ALLOWED)  # the restriction changes the output
    got = run_engine(engine, {"r": (PROMPT, params)})["r"]
    assert got == _reference(engine.tokenizer.encode(PROMPT), 12)
    seeded = run_engine(engine, {"s": (PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=3,
                                                              allowed_token_ids=ALLOWED))})["s"]
    assert set(seeded) <= set(ALLOWED)


def test_speculation_and_async_scheduling_keep_the_restriction_and_the_tokens():
    params = SamplingParams(max_tokens=24, temperature=0.0, allowed_token_ids=ALLOWED)
    plain = run_engine(make_engine(BUNDLED_MODEL), {"r": (PROMPT, params)})["r"]
    spec = make_engine(BUNDLED_MODEL, speculative_method="ngram", num_speculative_tokens=4, ngram_min=1,
                       speculative_adaptive=False)
    assert run_engine(spec, {"r": (PROMPT, params)})["r"] == plain
    assert spec.speculator.stats.num_drafts > 0  # it did speculate
    assert run_engine(make_engine(BUNDLED_MODEL, async_scheduling=True), {"r": (PROMPT, params)})["r"] == plain


def test_validation_the_wire_and_the_parallel_worker():
    p = SamplingParams(allowed_token_ids=[5, 9])
    assert params_from_proto(params_to_proto(p)) == p
    for bad in ([], [512], [-1], [True]):
        with pytest.raises(InvalidRequestError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad).validate(512)
    engine = make_engine(BUNDLED_MODEL)
    engine.add_request(PROMPT, SamplingParams(max_tokens=2, allowed_token_ids=ALLOWED), "a")
    engine.add_request(PROMPT, SamplingParams(max_tokens=2), "b")
    seqs = [engine.requests[r][0] for r in ("a", "b")]
    assert plan(seqs, [0, 1]).rows == [1]  # the masked row is sampled on the driver
