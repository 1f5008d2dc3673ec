"""Prompt logprobs equal transformers' log-softmax (fp32, within 1e-4), across prefill chunks, with the
prompt already in the prefix cache, and after preemption."""

from __future__ import annotations

import pytest
from helpers import PROMPTS, hf_logprobs, make_engine
from kvrelay.engine.sampling_params import SamplingParams

from kvrelay.models import BUNDLED_MODEL


def _prompt_logprobs(engine, prompt: str, k: int = 3, rid: str = "p"):
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=k), rid)
    got = None
    while engine.has_work():
        for o in engine.step():
            if o.request_id == rid and o.prompt_logprobs is not None:
                assert got is None  # handed out once
                got = o.prompt_logprobs
    return got


@pytest.mark.parametrize("budget", [512, 7])  # one prefill chunk, or many
def test_prompt_logprobs_equal_transformers(budget):
    engine = make_engine(BUNDLED_MODEL, max_num_batched_tokens=budget)
    prompt = PROMPTS[2]
    engine.add_request(prompt, SamplingParams(max_tokens=2), "warm")  # puts the prompt in the prefix cache
    while engine.has_work():
        engine.step()
    ids = engine.tokenize_prompt(prompt)
    got = _prompt_logprobs(engine, prompt)
    ref = hf_logprobs(str(BUNDLED_MODEL), ids)
    assert got[0] is None and len(got) == len(ids)
    for p in range(1, len(ids)):
        lp = got[p]
        assert lp.token_id == ids[p]
        assert abs(lp.logprob - float(ref[p - 1, ids[p]])) < 1e-4
        top = ref[p - 1].topk(3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert max(abs(v - float(r)) for (_, v), r in zip(lp.top, top.values)) < 1e-4


def test_prompt_logprobs_survive_preemption():
    engine = make_engine(BUNDLED_MODEL, num_kv_blocks=8, max_model_len=128, max_num_batched_tokens=16)
    for i in range(6):
        engine.add_request(PROMPTS[i], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), f"n{i}")
    prompt = PROMPTS[5]
    got = _prompt_logprobs(engine, prompt, k=0)
    assert engine.stats().num_preemptions > 0
    ids = engine.tokenize_prompt(prompt)
    ref = hf_logprobs(str(BUNDLED_MODEL), ids)
    assert all(abs(got[p].logprob - float(ref[p - 1, ids[p]])) < 1e-4 and got[p].top == [] for p in range(1, len(ids)))
