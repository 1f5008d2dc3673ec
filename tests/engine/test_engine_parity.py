"""Greedy output identical to Hugging Face transformers, under every scheduling condition."""

from __future__ import annotations

import pytest
from helpers import PROMPTS, greedy, hf_greedy, hf_logprobs, make_engine, run_engine
from kvrelay.engine.sampling_params import SamplingParams

from kvrelay.models import BUNDLED_MODEL

STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, "
    "she saw a big, red ball. She wanted to play with it, but it was too high.\nLily's mom said"
)


def _check_parity(model_dir, prompts, n_tokens, **engine_kw):
    engine = make_engine(model_dir, **engine_kw)
    requests = {str(i): (p, greedy(n_tokens)) for i, p in enumerate(prompts)}
    out = run_engine(engine, requests)
    for i, p in enumerate(prompts):
        ids = engine.tokenizer.encode_prompt(p)
        assert out[str(i)] == hf_greedy(str(model_dir), tuple(ids), n_tokens), f"prompt {i}: {p!r}"
    return engine


def test_stories260k_greedy_matches_transformers_and_llama2c_sample():
    engine = make_engine(BUNDLED_MODEL)
    engine.add_request("Once upon a time", SamplingParams(max_tokens=64, temperature=0.0), "story")
    text, ids = "", []
    while engine.has_work():
        for o in engine.step():
            text += o.text
            ids += o.new_token_ids
    prompt_ids = engine.tokenizer.encode_prompt("Once upon a time")
    assert ids == hf_greedy(str(BUNDLED_MODEL), tuple(prompt_ids), 64)
    assert "Once upon a time" + text == STORY


@pytest.mark.parametrize(
    "arch", ["llama", "llama_linear_rope", "llama3_rope_tied", "mistral", "qwen2", "qwen3"]
)
def test_tiny_architectures_greedy_match_transformers(tiny_models, arch):
    _check_parity(tiny_models[arch], PROMPTS, 48)


@pytest.mark.parametrize("batch", [1, 4, 16])
def test_batches_of_mixed_prompt_lengths(batch):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(batch)]
    _check_parity(BUNDLED_MODEL, prompts, 40)


def test_tiny_chunks_force_chunked_prefill(tiny_models):
    # A 5-token budget splits every prompt into chunks and mixes them with running decodes.
    _check_parity(tiny_models["llama"], PROMPTS, 32, max_num_batched_tokens=5)
    _check_parity(BUNDLED_MODEL, PROMPTS, 32, max_num_batched_tokens=5)


def test_prefix_cache_hits_give_identical_tokens():
    engine = make_engine(BUNDLED_MODEL)
    shared = PROMPTS[2]  # 20+ tokens: at least one full block
    first = run_engine(engine, {"a": (shared, greedy(24))})
    before = engine.stats().prefix_cache_hits
    second = run_engine(engine, {"b": (shared, greedy(24)), "c": (shared + " The dog", greedy(24))})
    assert engine.stats().prefix_cache_hits > before
    ids = engine.tokenizer.encode_prompt(shared)
    assert first["a"] == second["b"] == hf_greedy(str(BUNDLED_MODEL), tuple(ids), 24)
    ids_c = engine.tokenizer.encode_prompt(shared + " The dog")
    assert second["c"] == hf_greedy(str(BUNDLED_MODEL), tuple(ids_c), 24)


def test_tiny_kv_pool_preempts_and_still_matches():
    # 40 blocks of 16 tokens for 8 sequences of ~60-90 tokens: they cannot all fit at once.
    engine = _check_parity(BUNDLED_MODEL, PROMPTS + PROMPTS[:2], 64, num_kv_blocks=40, max_model_len=256)
    assert engine.stats().num_preemptions > 0
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("model", ["stories", "llama", "qwen2"])
def test_fp32_logprobs_within_1e4_of_transformers(tiny_models, model):
    model_dir = BUNDLED_MODEL if model == "stories" else tiny_models[model]
    engine = make_engine(model_dir, max_num_batched_tokens=6)
    prompt = PROMPTS[2]
    engine.add_request(prompt, SamplingParams(max_tokens=24, temperature=0.0, logprobs=20), "x")
    outs = []
    while engine.has_work():
        outs += engine.step()
    ids = engine.tokenizer.encode_prompt(prompt)
    generated = [o.new_token_ids[0] for o in outs]
    ref = hf_logprobs(str(model_dir), ids + generated)

    def close(a: float, b: float) -> bool:
        # The trained model within 1e-4 absolute; random tiny models (init 1.0, large activations)
        # within 1e-4 relative to the value.
        return abs(a - b) <= 1e-4 * (1.0 if model == "stories" else max(1.0, abs(b)))

    for j, o in enumerate(outs):
        row = ref[len(ids) - 1 + j]
        lp = o.logprobs[0]
        assert close(lp.logprob, float(row[lp.token_id]))
        assert len(lp.top) == 20
        for token_id, value in lp.top:
            assert close(value, float(row[token_id]))
