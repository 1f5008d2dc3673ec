"""Bad input gets one clear error, before anything is scheduled; bad model folders name what is wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import make_engine
from kvrelay.engine.errors import InvalidRequestError, ModelLoadError, PromptTooLongError
from kvrelay.engine.sampling_params import SamplingParams
from safetensors.torch import load_file, save_file

from kvrelay.models import BUNDLED_MODEL


@pytest.fixture(scope="module")
def engine():
    return make_engine(BUNDLED_MODEL)


@pytest.mark.parametrize(
    "params, field",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10_000}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 5.0}, "presence_penalty"),
        ({"frequency_penalty": -9.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": 50}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [100_000]}, "stop_token_ids"),
        ({"seed": "abc"}, "seed"),
        ({"logit_bias": {512: 1.0}}, "logit_bias"),  # stories260K's vocab is 512
        ({"logit_bias": {5: 101.0}}, "logit_bias"),
        ({"logit_bias": {5: float("inf")}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
    ],
)
def test_invalid_sampling_params_name_the_field(engine, params, field):
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("Lily", SamplingParams(**params), f"bad-{field}")
    assert e.value.field == field and field in str(e.value)
    assert not engine.has_work() and engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("prompt", ["", [], [1, 2, 99_999], [1, -1], "x" * 0, [1, "a"]])
def test_invalid_prompts(engine, prompt):
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request(prompt, SamplingParams(), "bad-prompt")
    assert e.value.field == "prompt"
    assert not engine.has_work()


def test_prompt_longer_than_context(engine):
    with pytest.raises(PromptTooLongError) as e:
        engine.add_request([5] * 600, SamplingParams(), "long")
    assert e.value.num_tokens == 600 and "512" in str(e.value)


def test_duplicate_request_id(engine):
    engine.add_request("Lily", SamplingParams(max_tokens=2), "dup")
    with pytest.raises(InvalidRequestError):
        engine.add_request("Lily", SamplingParams(max_tokens=2), "dup")
    while engine.has_work():
        engine.step()


def _copy_model(tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(BUNDLED_MODEL, dst)
    return dst


def _edit_config(model_dir, **changes):
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(changes)
    (model_dir / "config.json").write_text(json.dumps(cfg))


def test_unknown_architecture(tmp_path):
    d = _copy_model(tmp_path)
    _edit_config(d, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="unsupported architecture.*GPT2LMHeadModel.*LlamaForCausalLM"):
        make_engine(d)


def test_unsupported_rope_type(tmp_path):
    d = _copy_model(tmp_path)
    _edit_config(d, rope_scaling={"rope_type": "mrope", "factor": 4.0})
    with pytest.raises(ModelLoadError, match="unsupported rope type 'mrope'.*yarn"):
        make_engine(d)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors"])
def test_missing_file(tmp_path, name):
    d = _copy_model(tmp_path)
    (d / name).unlink()
    with pytest.raises(ModelLoadError, match=name.split(".")[0]):
        make_engine(d)


def test_missing_tensor_is_named(tmp_path):
    d = _copy_model(tmp_path)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.3.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.3\.mlp\.up_proj\.weight.*\[172, 64\].*missing"):
        make_engine(d)


def test_wrong_shape_names_file_tensor_and_expected(tmp_path):
    d = _copy_model(tmp_path)
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ModelLoadError) as e:
        make_engine(d)
    msg = str(e.value)
    assert "model.safetensors" in msg and "k_proj" in msg and "[16, 64]" in msg and "[32, 64]" in msg


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    d = _copy_model(tmp_path)
    tensors = load_file(d / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, d / fname)
    (d / "model.safetensors").unlink()
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    from helpers import run_engine

    a = run_engine(make_engine(d), {"x": ("Lily", SamplingParams(max_tokens=10, temperature=0))})
    b = run_engine(make_engine(BUNDLED_MODEL), {"x": ("Lily", SamplingParams(max_tokens=10, temperature=0))})
    assert a == b


def test_dummy_load_format_needs_only_config_and_tokenizer(tmp_path):
    d = tmp_path / "dummy"
    d.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL / name, d / name)
    engine = make_engine(d, load_format="dummy")
    from helpers import run_engine

    out = run_engine(engine, {"x": ("Lily", SamplingParams(max_tokens=5, temperature=0))})
    assert len(out["x"]) == 5


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_dtypes_run_and_mostly_agree_with_fp32(dtype):
    from helpers import run_engine

    ref = run_engine(
        make_engine(BUNDLED_MODEL), {"x": ("Once upon a time", SamplingParams(max_tokens=8, temperature=0))}
    )
    out = run_engine(
        make_engine(BUNDLED_MODEL, dtype=dtype),
        {"x": ("Once upon a time", SamplingParams(max_tokens=8, temperature=0))},
    )
    assert out["x"][:3] == ref["x"][:3]


def test_kv_pool_too_small_for_one_sequence_is_rejected():
    with pytest.raises(ValueError, match="raise --kv-cache-memory"):
        make_engine(BUNDLED_MODEL, num_kv_blocks=4)
