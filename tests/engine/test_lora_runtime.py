"""LoRA adapters loaded and unloaded while the engine serves: a loaded adapter equals PEFT's; an
unloaded one is refused to new requests while running ones finish with it; a new adapter under an
old name gets none of the old one's cached K/V; slots are reused only once free."""

from __future__ import annotations

import pytest
import torch
from helpers import make_engine, run_engine
from kvrelay.engine.errors import InvalidRequestError
from kvrelay.engine.lora.adapter import load_adapter
from kvrelay.engine.lora.runtime import LoRAUpdateError, add_adapter, remove_adapter
from kvrelay.engine.sampling_params import SamplingParams
from lora_adapters import ATTENTION, peft_greedy, save_adapter, two_adapters

from kvrelay.models import BUNDLED_MODEL

PROMPT = "The little bird flew over the big tree and saw a cat who was very hungry and sad. The cat said"
N = 10


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    return two_adapters(tmp_path_factory.mktemp("lora"), BUNDLED_MODEL)


def _greedy(lora: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=N, min_tokens=N, temperature=0.0, lora=lora)


def _load(engine, name: str, folder: str) -> None:
    add_adapter(engine, load_adapter(name, folder, engine.config, engine.args.max_lora_rank, engine.dtype))


def test_load_serve_unload_and_reload_under_the_same_name(folders):
    engine = make_engine(BUNDLED_MODEL, enable_lora=True)
    ids = engine.tokenizer.encode(PROMPT)
    _load(engine, "x", folders["attn"])
    assert run_engine(engine, {"1": (PROMPT, _greedy("x"))})["1"] == peft_greedy(BUNDLED_MODEL, folders["attn"], ids, N)
    remove_adapter(engine, "x")
    with pytest.raises(InvalidRequestError, match="no LoRA adapter 'x' is loaded \\(loaded: none\\)"):
        engine.add_request(PROMPT, _greedy("x"), "2")
    # Another adapter under the name: the same prompt computes afresh (the earlier K/V were attn's).
    _load(engine, "x", folders["full"])
    engine.add_request(PROMPT, _greedy("x"), "3")
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert [t for o in outs for t in o.new_token_ids] == peft_greedy(BUNDLED_MODEL, folders["full"], ids, N)
    assert outs[-1].num_cached_tokens == 0
    assert engine.model.adapters.names == ["x"]  # the free slot was reused
    # A decode worker's probe of the cache salts as the request did (by the load's key, x@N).
    assert engine.probe_cached_blocks(ids, None, "x") == len(ids) // engine.args.block_size
    assert run_engine(engine, {"4": (PROMPT, _greedy(None))})["4"] != run_engine(engine, {"5": (PROMPT, _greedy("x"))})["5"]


def test_a_running_request_finishes_with_an_unloaded_adapter_whose_slot_waits(folders):
    engine = make_engine(BUNDLED_MODEL, enable_lora=True)
    _load(engine, "x", folders["full"])
    engine.add_request(PROMPT, _greedy("x"), "r")
    outs = engine.step()  # the prompt computed, the first token sampled
    remove_adapter(engine, "x")
    _load(engine, "y", folders["attn"])  # slot 0 is still in use: a new one
    assert engine.model.adapters.names == ["x", "y"]
    while engine.has_work():
        outs += engine.step()
    ids = engine.tokenizer.encode(PROMPT)
    assert [t for o in outs for t in o.new_token_ids] == peft_greedy(BUNDLED_MODEL, folders["full"], ids, N)
    _load(engine, "z", folders["full"])  # now slot 0 is free again
    assert engine.model.adapters.names == ["z", "y"]
    assert run_engine(engine, {"y": (PROMPT, _greedy("y"))})["y"] == peft_greedy(BUNDLED_MODEL, folders["attn"], ids, N)


def test_refusals(folders):
    engine = make_engine(BUNDLED_MODEL, enable_lora=True)
    _load(engine, "x", folders["attn"])
    with pytest.raises(LoRAUpdateError, match="'x' has already been loaded"):
        _load(engine, "x", folders["full"])
    with pytest.raises(LoRAUpdateError, match="is the base model's name"):
        _load(engine, "stories260K", folders["full"])
    with pytest.raises(LoRAUpdateError, match="'nope' is not loaded") as e:
        remove_adapter(engine, "nope")
    assert e.value.status == 404
    with pytest.raises(LoRAUpdateError, match="start it with --enable-lora") as e:
        _load(make_engine(BUNDLED_MODEL), "x", folders["attn"])
    assert e.value.status == 501


def test_a_load_that_fails_leaves_the_loaded_adapters_serving(tmp_path):
    """On a mixture-of-experts model an adapter may target attention only: one that targets the MLP
    fails as it is attached, before anything changed; the adapter already loaded keeps its output."""
    from kvrelay.engine.errors import ModelLoadError
    from safetensors.torch import load_file, save_file
    from tiny_models import save_tiny_model

    model = save_tiny_model(tmp_path / "mixtral", "mixtral")
    good = save_adapter(model, tmp_path / "good", ATTENTION, r=4, alpha=8, seed=1, scale=0.5)
    engine = make_engine(model, enable_lora=True)
    _load(engine, "good", str(good))
    before = run_engine(engine, {"1": (PROMPT, _greedy("good"))})["1"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    tensors = load_file(str(good / "adapter_model.safetensors"))
    h, i = engine.config.hidden_size, engine.config.intermediate_size
    prefix = "base_model.model.model.layers.0.mlp.gate_proj"
    tensors |= {f"{prefix}.lora_A.weight": torch.zeros(4, h), f"{prefix}.lora_B.weight": torch.zeros(i, 4)}
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(ModelLoadError, match="may target attention only"):
        _load(engine, "bad", str(bad))
    assert list(engine.model.adapters.index) == ["good"]
    assert run_engine(engine, {"2": (PROMPT, _greedy("good"))})["2"] == before
    assert before != run_engine(engine, {"3": (PROMPT, _greedy(None))})["3"]
