"""A grammar that waits for a reasoning model's thinking (GuidedSpec.think_tokens), as vLLM applies
structured output after the reasoning: the think block is sampled as if unconstrained, the grammar
holds from the token after its end, and the first token may open the block. The same tokens with
speculative decoding and with async scheduling; the wire carries the think tokens."""

from __future__ import annotations

import re

import pytest
from helpers import make_engine
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.structured.spec import GuidedSpec
from kvrelay.kvtransfer.convert import params_from_proto, params_to_proto

from kvrelay.models import BUNDLED_MODEL

PROMPT = "Once upon a time"
DIGITS = "[0-9]{3}"


@pytest.fixture(scope="module")
def free():
    """The unconstrained greedy tokens, and where the thinking will end: the fifth token at the
    earliest, one that has not come before (the end token's first appearance ends the thinking)."""
    engine = make_engine(BUNDLED_MODEL)
    tokens = _generate(engine, SamplingParams(max_tokens=40, temperature=0.0))[0]
    end = next(i for i in range(4, len(tokens)) if tokens[i] not in tokens[:i])
    return engine.tokenizer, tokens, end


def _generate(engine, params: SamplingParams) -> tuple[list[int], str, str]:
    ids, text, reason = [], "", None
    engine.add_request(PROMPT, params, "r")
    while engine.has_work():
        for o in engine.step():
            ids += o.new_token_ids
            text += o.text
            reason = o.finish_reason or reason
    assert engine.pool.num_free == engine.pool.num_blocks
    return ids, text, reason


def _run(spec: GuidedSpec, **engine_kw) -> tuple[list[int], str, str]:
    return _generate(make_engine(BUNDLED_MODEL, **engine_kw), SamplingParams(max_tokens=40, temperature=0.0,
                                                                            structured=spec))


@pytest.mark.parametrize("opened", [True, False])
def test_thinking_is_free_and_the_answer_follows_the_grammar(free, opened):
    tok, tokens, end = free
    # opened: the prompt opened the block; else the first token opens it (the greedy's first token,
    # which the first step allows beside what the grammar allows).
    spec = GuidedSpec("regex", DIGITS, think_tokens=(tokens[0], tokens[end]), thinking=opened)
    ids, _, reason = _run(spec)
    assert ids[: end + 1] == tokens[: end + 1]  # the thinking, exactly the unconstrained tokens
    answer = tok.decode(ids[end + 1:])
    assert re.fullmatch(DIGITS, answer), answer
    assert reason == "stop"


def test_a_first_token_that_does_not_open_the_block_starts_the_grammar(free):
    _, tokens, end = free
    # A start token the model does not pick over the digits here (greedy, so this holds run to run).
    never = next(t for t in range(3, 500) if t not in tokens)
    ids, text, reason = _run(GuidedSpec("regex", DIGITS, think_tokens=(never, tokens[end])))
    assert re.fullmatch(DIGITS, text) and reason == "stop", text
    # Without think tokens: the same.
    assert _run(GuidedSpec("regex", DIGITS))[0] == ids


@pytest.mark.parametrize("engine_kw", [
    {"speculative_method": "ngram", "num_speculative_tokens": 4, "ngram_min": 1, "speculative_adaptive": False},
    {"async_scheduling": True},
], ids=["ngram", "async"])
def test_speculation_and_async_scheduling_give_the_same_tokens(free, engine_kw):
    _, tokens, end = free
    for opened in (True, False):
        spec = GuidedSpec("regex", DIGITS, think_tokens=(tokens[0], tokens[end]), thinking=opened)
        assert _run(spec, **engine_kw) == _run(spec)


def test_the_wire_carries_the_think_tokens():
    for spec in (GuidedSpec("regex", DIGITS, "response_format", (5, 9), True), GuidedSpec("json", "{}", "x")):
        p = SamplingParams(structured=spec)
        assert params_from_proto(params_to_proto(p)) == p
    bad = SamplingParams(structured=GuidedSpec("regex", DIGITS, think_tokens=(5, 512)))
    with pytest.raises(Exception, match="think tokens"):
        bad.validate(512)
