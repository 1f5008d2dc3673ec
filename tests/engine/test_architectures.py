"""The architecture registry and the families beyond Llama: Gemma 2, Gemma 3 (text), Phi-3,
and sliding-window attention, each with greedy parity against transformers."""

from __future__ import annotations

import json

import pytest
from helpers import PROMPTS, greedy, hf_greedy, make_engine, run_engine
from kvrelay.engine import architectures
from kvrelay.engine.architectures import llama
from kvrelay.engine.architectures.base import Architecture
from kvrelay.engine.errors import ModelLoadError
from tiny_models import save_tiny_model

LONG_PROMPT = PROMPTS[2] + " " + PROMPTS[5]  # 78 tokens: past Phi-3's tiny original context of 64


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("arch_models")
    return {
        # Layer 0 slides over 16 tokens, layer 1 is global; soft-capping at the defaults 50 / 30.
        "gemma2": save_tiny_model(root / "gemma2", "gemma2"),
        "gemma3": save_tiny_model(
            root / "gemma3",
            "gemma3",
            num_hidden_layers=3,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
        ),
        "phi3": save_tiny_model(root / "phi3", "phi3"),
        "phi3_longrope": save_tiny_model(
            root / "phi3_longrope",
            "phi3",
            original_max_position_embeddings=64,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0] * 4 + [1.5] * 4,
                "long_factor": [1.0 + 0.5 * i for i in range(8)],
                "original_max_position_embeddings": 64,
            },
        ),
        # Every layer slides over 16 tokens: blocks behind the window are freed.
        "mistral_window": save_tiny_model(root / "mistral_window", "mistral", sliding_window=16),
        # Layer 0 global, layer 1 sliding: nothing can be freed, the kernels still apply the window.
        "qwen2_mixed": save_tiny_model(
            root / "qwen2_mixed", "qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1
        ),
    }


def _parity(model_dir, prompts, n, **engine_kw):
    engine = make_engine(model_dir, **engine_kw)
    out = run_engine(engine, {str(i): (p, greedy(n)) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        ids = engine.tokenizer.encode_prompt(p)
        assert out[str(i)] == hf_greedy(str(model_dir), tuple(ids), n), f"prompt {i}: {p!r}"
    return engine


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3"])
def test_new_architectures_greedy_match_transformers(models, name):
    # 48 tokens after prompts of up to 39: contexts of several 16-token windows.
    engine = _parity(models[name], PROMPTS, 48)
    assert engine.config.architecture == json.loads((models[name] / "config.json").read_text())["architectures"][0]


def test_gemma_recipe_is_read_from_the_config(models):
    cfg = make_engine(models["gemma3"]).config
    assert cfg.windows == (16, None, 16)
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.hidden_act == "gelu_tanh"
    assert cfg.local_rope_theta == 1000.0 and cfg.rope_type == "linear"
    assert cfg.attn_scale == pytest.approx(24**-0.5) and cfg.embed_scale == pytest.approx(8.0)
    cfg2 = make_engine(models["gemma2"]).config
    assert (cfg2.attn_softcap, cfg2.final_softcap, cfg2.windows) == (50.0, 30.0, (16, None))


def test_gemma2_chunked_prefill_across_windows(models):
    _parity(models["gemma2"], PROMPTS, 24, max_num_batched_tokens=5, kernel_backend="torch")


def test_phi3_longrope_short_within_and_long_past_the_original_context(models):
    # max_model_len within the original 64 tokens: short factors, as transformers uses there.
    engine = _parity(models["phi3_longrope"], PROMPTS, 16, max_model_len=64)
    # A longer context: long factors for every position, as transformers uses for a 78-token prompt.
    _parity(models["phi3_longrope"], [LONG_PROMPT], 16)
    assert engine.model.cos_sin_cache.shape[0] == 64


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_sliding_window_frees_blocks_behind_it_and_matches(models, backend):
    # 6 sequences of 53-87 tokens need 100 blocks of 4 tokens with full attention; the pool has 40.
    # With a 16-token window each holds at most ~6 blocks once its prompt is in, so none is preempted.
    engine = _parity(
        models["mistral_window"], PROMPTS, 48, block_size=4, max_model_len=128, num_kv_blocks=40,
        kernel_backend=backend,
    )
    assert engine.scheduler.config.sliding_window == 16
    assert engine.stats().num_preemptions == 0
    assert engine.pool.num_free == engine.pool.num_blocks  # dropped blocks were not freed twice
    assert engine.max_model_len == 128  # no longer capped at the window


def test_sliding_window_with_chunked_prefill_and_prefix_cache(models):
    engine = _parity(models["mistral_window"], PROMPTS, 32, block_size=4, max_num_batched_tokens=7)
    before = engine.stats().prefix_cache_hits
    # The same long prompt again: its leading blocks were dropped but stay in the prefix cache.
    again = run_engine(engine, {"again": (PROMPTS[2], greedy(32))})
    assert engine.stats().prefix_cache_hits > before
    ids = engine.tokenizer.encode_prompt(PROMPTS[2])
    assert again["again"] == hf_greedy(str(models["mistral_window"]), tuple(ids), 32)


def test_mixed_sliding_and_global_layers_keep_blocks(models):
    engine = _parity(models["qwen2_mixed"], PROMPTS, 40)
    assert engine.config.windows == (None, 16)
    assert engine.scheduler.config.sliding_window is None


def test_unknown_architecture_lists_every_supported_one(tmp_path, models):
    d = tmp_path / "m"
    d.mkdir()
    cfg = json.loads((models["phi3"] / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"architectures": ["FalconForCausalLM"]}))
    with pytest.raises(ModelLoadError) as e:
        make_engine(d)
    for name in ("FalconForCausalLM", "LlamaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                 "Phi3ForCausalLM", "Qwen3ForCausalLM"):
        assert name in str(e.value)


def test_registering_a_taken_name_is_an_error():
    dup = Architecture("LlamaForCausalLM", llama.ARCHITECTURES[0].parse_config, llama.expected_shapes,
                       llama.assemble)
    with pytest.raises(ValueError, match="'LlamaForCausalLM' from my-plugin is already registered"):
        architectures.register(dup, source="my-plugin")


def test_missing_fused_tensor_is_named(tmp_path, models):
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "phi3"
    shutil.copytree(models["phi3"], d)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.self_attn.qkv_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight.*\[128, 64\].*missing"):
        make_engine(d)
