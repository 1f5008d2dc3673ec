"""bad_words (vLLM's): greedy output with words banned equals transformers' generate with the same
token sequences as bad_words_ids; speculation and async scheduling keep it; the wire carries it."""

from __future__ import annotations

import pytest
import torch
from helpers import _hf_model, make_engine, run_engine
from kvrelay.engine.bad_words import word_forms
from kvrelay.engine.errors import InvalidRequestError
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.convert import params_from_proto, params_to_proto

from kvrelay.models import BUNDLED_MODEL

PROMPT = "Once upon a time, there was a little girl named Lily. She loved"
N = 24


def _params(bad_words=None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=N, min_tokens=N, temperature=0.0, bad_words=bad_words, **kw)


@pytest.fixture(scope="module")
def case():
    """The engine, the free greedy text, and two words of it: one a single token, one several."""
    engine = make_engine(BUNDLED_MODEL)
    free = run_engine(engine, {"free": (PROMPT, _params())})["free"]
    words = engine.tokenizer.decode(free).split()
    size = {w: len(engine.tokenizer.encode_plain(w, add_special_tokens=False)) for w in words}
    single = next(w for w in words if size[w] == 1)
    multi = next(w for w in words if size[w] > 1)
    return engine, free, [single, multi]


@pytest.mark.parametrize("which", ["multi-token word", "both words"])
def test_banned_words_leave_the_output_as_transformers_bans_them(case, which):
    engine, free, (single, multi) = case
    words = [multi] if which == "multi-token word" else [single, multi]
    forms = word_forms(engine.tokenizer, words)
    got = run_engine(engine, {which: (PROMPT, _params(words))})[which]
    assert got != free
    text = engine.tokenizer.decode(got)
    assert not any(w in text.split() for w in words), text
    ids = engine.tokenizer.encode(PROMPT)
    with torch.no_grad():
        ref = _hf_model(str(BUNDLED_MODEL)).generate(torch.tensor([ids]), max_new_tokens=N, min_new_tokens=N,
                                                     do_sample=False, bad_words_ids=forms)
    assert got == ref[0, len(ids):].tolist()


@pytest.mark.parametrize("option", [{"speculative_method": "ngram", "speculative_adaptive": False},
                                    {"async_scheduling": True}], ids=["ngram", "async"])
def test_speculation_and_async_scheduling_keep_the_ban(case, option):
    engine, _, words = case
    other = make_engine(BUNDLED_MODEL, **option)
    requests = {"b": (PROMPT, _params(words)), "free": (PROMPT, _params())}
    assert run_engine(other, requests) == run_engine(engine, {k: v for k, v in requests.items()})


def test_validation_and_the_wire(case):
    engine, _, words = case
    with pytest.raises(InvalidRequestError, match="bad_words: must be a list of at most 100"):
        engine.add_request(PROMPT, _params(["w"] * 101), "x")
    with pytest.raises(InvalidRequestError, match="bad_words"):
        engine.add_request(PROMPT, _params(["  "]), "y")
    assert params_from_proto(params_to_proto(_params(words))).bad_words == words
    assert params_from_proto(params_to_proto(_params())).bad_words is None
