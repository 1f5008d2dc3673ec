"""Rope scaling: each type's frequencies and attention factor against transformers' own
functions, and greedy parity on tiny models with yarn and dynamic NTK scaling."""

from __future__ import annotations

import pytest
import torch
from helpers import PROMPTS, greedy, hf_greedy, make_engine, run_engine
from kvrelay.engine.rope import context_limit, inv_freq_and_scale, rope_cos_sin_table
from tiny_models import save_tiny_model

HEAD_DIM, MAX_POS = 32, 512

VARIANTS = [
    ("default", {}),
    ("linear", {"factor": 4.0}),
    ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}),
    ("dynamic", {"factor": 2.0}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 128}),
    ("yarn", {"factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16, "beta_slow": 2,
              "truncate": False}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 0.5}),
    ("yarn", {"factor": 4.0, "original_max_position_embeddings": 128, "attention_factor": 1.3}),
    ("longrope", {"short_factor": [1.0 + 0.1 * i for i in range(16)], "long_factor": [2.0 + i for i in range(16)],
                  "original_max_position_embeddings": 128}),
]


def _hf(rope_type: str, params: dict, seq_len: int):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM, max_position_embeddings=MAX_POS,
        rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0, **params},
    )
    if rope_type == "default":
        inv = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float) / HEAD_DIM))
        return inv, 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=seq_len)


@pytest.mark.parametrize("max_positions", [MAX_POS // 4, MAX_POS, 4 * MAX_POS])
@pytest.mark.parametrize("rope_type,params", VARIANTS, ids=[f"{t}-{i}" for i, (t, _) in enumerate(VARIANTS)])
def test_frequencies_and_attention_factor_match_transformers(rope_type, params, max_positions):
    # transformers computes dynamic and longrope tables for the current length; the engine bakes
    # the one for its longest context, max_positions.
    want_inv, want_scale = _hf(rope_type, params, max_positions)
    got_inv, got_scale = inv_freq_and_scale(rope_type, params, 10000.0, HEAD_DIM, MAX_POS, max_positions)
    torch.testing.assert_close(got_inv, want_inv.float(), rtol=1e-6, atol=0)
    assert got_scale == pytest.approx(float(want_scale), rel=1e-9)
    table = rope_cos_sin_table(rope_type, params, 10000.0, HEAD_DIM, MAX_POS, max_positions)[:64]
    positions = torch.arange(64, dtype=torch.float)[:, None] * want_inv.float()[None, :]
    torch.testing.assert_close(table[:, : HEAD_DIM // 2], positions.cos() * want_scale, rtol=1e-5, atol=1e-5)


def test_dynamic_and_yarn_stretch_the_context():
    assert context_limit("dynamic", {"factor": 2.0}, 512) == 1024
    assert context_limit("yarn", {"factor": 4.0, "original_max_position_embeddings": 256}, 512) == 1024
    assert context_limit("longrope", {}, 512) == 512


@pytest.fixture(scope="module")
def scaled_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("rope_models")
    return {
        "yarn": save_tiny_model(root / "yarn", "llama", head_dim=32, rope_scaling={
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
        "dynamic": save_tiny_model(root / "dynamic", "qwen2", rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    }


def test_yarn_greedy_matches_transformers(scaled_models):
    engine = make_engine(scaled_models["yarn"])
    assert engine.max_model_len == 512
    out = run_engine(engine, {str(i): (p, greedy(48)) for i, p in enumerate(PROMPTS)})
    for i, p in enumerate(PROMPTS):
        ids = engine.tokenizer.encode_prompt(p)
        assert out[str(i)] == hf_greedy(str(scaled_models["yarn"]), tuple(ids), 48)


def test_dynamic_ntk_within_the_trained_context_matches_transformers(scaled_models):
    # Within max_position_embeddings transformers keeps the trained frequencies; so does the engine
    # when it serves no longer contexts (by default it serves factor x longer, with the stretched table).
    assert make_engine(scaled_models["dynamic"]).max_model_len == 1024
    engine = make_engine(scaled_models["dynamic"], max_model_len=512)
    out = run_engine(engine, {str(i): (p, greedy(48)) for i, p in enumerate(PROMPTS)})
    for i, p in enumerate(PROMPTS):
        ids = engine.tokenizer.encode_prompt(p)
        assert out[str(i)] == hf_greedy(str(scaled_models["dynamic"]), tuple(ids), 48)
