"""LoRA adapters (--lora-modules): each request's greedy tokens equal PEFT's with its adapter, in
batches that mix adapters and the base model; adapters keep prefix caches of their own; bad
adapters and bad requests fail clearly."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from helpers import PROMPTS, hf_greedy, make_engine, run_engine
from kvrelay.engine.errors import InvalidRequestError, ModelLoadError
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.convert import params_from_proto, params_to_proto
from lora_adapters import peft_greedy, save_adapter, two_adapters
from safetensors.torch import load_file, save_file

from kvrelay.models import BUNDLED_MODEL

N = 12


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, str]:
    return two_adapters(tmp_path_factory.mktemp("lora"), BUNDLED_MODEL)


@pytest.fixture(scope="module")
def engine(adapters):
    return make_engine(BUNDLED_MODEL, lora_modules=[f"{k}={v}" for k, v in adapters.items()], max_num_seqs=8,
                       max_num_batched_tokens=48)


def _greedy(lora: str | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=N, min_tokens=N, temperature=0.0, lora=lora)


def test_each_request_equals_peft_with_its_adapter_in_one_mixed_batch(engine, adapters):
    requests, expected = {}, {}
    for i, prompt in enumerate(PROMPTS):
        ids = engine.tokenizer.encode(prompt)
        for lora in (None, "attn", "full"):
            rid = f"{i}-{lora}"
            requests[rid] = (prompt, _greedy(lora))
            expected[rid] = (hf_greedy(str(BUNDLED_MODEL), tuple(ids), N) if lora is None
                             else peft_greedy(BUNDLED_MODEL, adapters[lora], ids, N))
    # 18 requests over 8 sequences and a 48-token budget: steps mix decodes and prefill chunks of
    # the base model and both adapters.
    got = run_engine(engine, requests)
    assert got == expected
    changed = [i for i in range(len(PROMPTS)) for lora in ("attn", "full") if got[f"{i}-{lora}"] != got[f"{i}-None"]]
    assert len(changed) >= len(PROMPTS)  # the adapters do change the output


def test_an_adapter_on_some_parts_of_a_fused_projection(tmp_path):
    """PEFT's default for Llama, q_proj and v_proj only: k's rows of the fused qkv get no delta; and
    up_proj without gate_proj or down_proj."""
    qv = save_adapter(BUNDLED_MODEL, tmp_path / "qv", ("q_proj", "v_proj", "up_proj"), r=4, alpha=8, seed=3,
                      scale=0.5)
    engine = make_engine(BUNDLED_MODEL, lora_modules=[f"qv={qv}"], max_num_batched_tokens=48)
    requests = {f"{i}-{lora}": (p, _greedy(lora)) for i, p in enumerate(PROMPTS[:4]) for lora in (None, "qv")}
    got = run_engine(engine, requests)
    for i, prompt in enumerate(PROMPTS[:4]):
        assert got[f"{i}-qv"] == peft_greedy(BUNDLED_MODEL, str(qv), engine.tokenizer.encode(prompt), N)
    assert any(got[f"{i}-qv"] != got[f"{i}-None"] for i in range(4))


def test_an_adapter_keeps_a_prefix_cache_of_its_own(engine):
    prompt = "The old man and the little dog walked along the river every morning, and one day they found a boat"
    first = run_engine(engine, {"base": (prompt, _greedy())})["base"]
    engine.add_request(prompt, _greedy("attn"), "a1")
    outs = []
    while engine.has_work():
        outs += engine.step()
    # The base model's cached blocks are not the adapter's K/V: nothing was served from them.
    assert next(o for o in outs if o.request_id == "a1" and o.finished).num_cached_tokens == 0
    engine.add_request(prompt, _greedy("attn"), "a2")
    outs = []
    while engine.has_work():
        outs += engine.step()
    again = next(o for o in outs if o.request_id == "a2" and o.finished)
    assert again.num_cached_tokens >= 16  # the adapter's own blocks are reused
    assert run_engine(engine, {"b2": (prompt, _greedy())})["b2"] == first


@pytest.mark.parametrize("option", [{"speculative_method": "ngram", "speculative_adaptive": False},
                                    {"async_scheduling": True}], ids=["ngram", "async"])
def test_speculation_and_async_scheduling_keep_the_adapters_tokens(adapters, option):
    plain = make_engine(BUNDLED_MODEL, lora_modules=[f"full={adapters['full']}"])
    other = make_engine(BUNDLED_MODEL, lora_modules=[f"full={adapters['full']}"], **option)
    requests = {f"{i}-{lora}": (p, _greedy(lora)) for i, p in enumerate(PROMPTS) for lora in (None, "full")}
    assert run_engine(other, requests) == run_engine(plain, requests)


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_tensor_and_pipeline_parallel_ranks_serve_the_adapters(engine, adapters, tp, pp):
    """Each rank holds its shard of every adapter (B's output rows on q/k/v/gate/up, A's input columns
    on o_proj/down: partial deltas that the projection's all-reduce sums); a stage its layers."""
    kw = {"lora_modules": [f"{k}={v}" for k, v in adapters.items()], "max_num_seqs": 8,
          "max_num_batched_tokens": 48, "kv_cache_memory": 4 * 2**20}
    parallel = make_engine(BUNDLED_MODEL, tensor_parallel_size=tp, pipeline_parallel_size=pp, **kw)
    try:
        requests = {f"tp{tp}pp{pp}-{i}-{lora}": (p, _greedy(lora)) for i, p in enumerate(PROMPTS[:4])
                    for lora in (None, "attn", "full")}
        assert run_engine(parallel, requests) == run_engine(engine, requests)
    finally:
        parallel.close()


def test_stats_count_requests_per_adapter(engine):
    assert engine.stats().lora_running == {"attn": 0, "full": 0} == engine.stats().lora_waiting
    for rid, lora in (("s1", "attn"), ("s2", "attn"), ("s3", None)):
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0, n=2, lora=lora), rid)
    assert engine.stats().lora_waiting == {"attn": 2, "full": 0}  # requests, not their n samples
    engine.step()
    assert engine.stats().lora_running == {"attn": 2, "full": 0}
    while engine.has_work():
        engine.step()
    assert engine.stats().lora_running == {"attn": 0, "full": 0} == engine.stats().lora_waiting
    assert make_engine(BUNDLED_MODEL).stats().lora_running == {}


def test_a_request_for_an_adapter_not_loaded_is_refused(engine):
    with pytest.raises(InvalidRequestError, match="no LoRA adapter 'nope' is loaded \\(loaded: attn, full\\)"):
        engine.add_request("Once", _greedy("nope"), "x")
    with pytest.raises(InvalidRequestError, match="lora: must be"):
        engine.add_request("Once", _greedy(""), "y")
    plain = make_engine(BUNDLED_MODEL)
    with pytest.raises(InvalidRequestError, match="loaded: none"):
        plain.add_request("Once", _greedy("attn"), "z")


def test_the_wire_carries_the_adapter():
    assert params_from_proto(params_to_proto(_greedy("attn"))).lora == "attn"
    assert params_from_proto(params_to_proto(_greedy())).lora is None


def test_bad_adapters_and_flags_fail_at_start_up(adapters, tmp_path):
    with pytest.raises(ModelLoadError, match="rank r=8 exceeds --max-lora-rank 4"):
        make_engine(BUNDLED_MODEL, lora_modules=[f"full={adapters['full']}"], max_lora_rank=4)
    with pytest.raises(ModelLoadError, match="no adapter_config.json"):
        make_engine(BUNDLED_MODEL, lora_modules=[f"x={tmp_path}"])
    with pytest.raises(ValueError, match="expected NAME=PATH"):
        make_engine(BUNDLED_MODEL, lora_modules=["just-a-path"])
    with pytest.raises(ValueError, match="given twice"):
        make_engine(BUNDLED_MODEL, lora_modules=[f"a={adapters['attn']}", f"a={adapters['full']}"])
    with pytest.raises(ValueError, match="--max-lora-rank must be >= 1"):
        make_engine(BUNDLED_MODEL, enable_lora=True, max_lora_rank=0)
    # An adapter of another model: its shapes do not fit.
    bad = tmp_path / "bad"
    bad.mkdir()
    shutil.copytree(adapters["attn"], bad, dirs_exist_ok=True)
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    key = next(k for k in tensors if "q_proj.lora_A" in k)
    tensors[key] = tensors[key][:, :32].contiguous()
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    with pytest.raises(ModelLoadError, match="q_proj: lora_A \\(4, 32\\)"):
        make_engine(BUNDLED_MODEL, lora_modules=[f"bad={bad}"])


def test_vllm_json_form_of_lora_modules(adapters):
    spec = json.dumps({"name": "attn", "path": adapters["attn"]})
    engine = make_engine(BUNDLED_MODEL, lora_modules=[spec])
    assert engine.model.adapters.names == ["attn"]


def test_generate_cli_runs_an_adapter(engine, adapters):
    argv = [sys.executable, "-m", "kvrelay.cli", "generate", PROMPTS[0], "--json", "--max-tokens", "8",
            "--lora-modules", f"attn={adapters['attn']}"]
    out = subprocess.run([*argv, "--lora", "attn"], capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    want = run_engine(engine, {"cli": (PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, lora="attn"))})
    assert json.loads(out.stdout)["token_ids"] == want["cli"]
    bad = subprocess.run([*argv, "--lora", "nope"], capture_output=True, text=True, timeout=120, check=False)
    assert bad.returncode == 2 and "no LoRA adapter 'nope'" in bad.stderr
