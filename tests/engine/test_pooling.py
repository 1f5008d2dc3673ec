"""The pooling runner (kvrelay.engine.pooling): embeddings equal transformers' pooled last hidden
state, through chunked prefill, the prefix cache, Matryoshka cuts, and the refusals."""

from __future__ import annotations

import json

import pytest
import torch
from embedding_models import (
    hf_class_probs,
    hf_vectors,
    save_bare_decoder,
    save_classifier,
    write_sentence_transformers,
)
from helpers import PROMPTS, make_engine
from kvrelay.engine.errors import InvalidRequestError, ModelLoadError, PromptTooLongError
from kvrelay.engine.pooling.config import PoolerConfig
from kvrelay.engine.pooling.params import PoolingParams
from kvrelay.engine.pooling.pooler import accumulate
from kvrelay.engine.sampling_params import SamplingParams

from kvrelay.models import BUNDLED_MODEL


def embed(engine, prompts, pooling: PoolingParams | None = None) -> list:
    """Every prompt submitted at once (one mixed, chunked batch); their final outputs, in order."""
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(pooling=pooling or PoolingParams()), f"e{i}")
    done = {}
    while engine.has_work():
        for out in engine.step():
            assert out.new_token_ids == []  # nothing is generated
            if out.finished:
                done[out.request_id] = out
    return [done[f"e{i}"] for i in range(len(prompts))]


def assert_close(outputs, reference) -> None:
    assert len(outputs) == len(reference)
    for out, ref in zip(outputs, reference):
        got = torch.tensor(out.embedding)
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("mode", ["LAST", "MEAN", "CLS"])
def test_bundled_model_pools_like_transformers(mode):
    # A 16-token budget cuts the long prompts into chunks; "A" is a one-token prompt.
    engine = make_engine(BUNDLED_MODEL, runner="pooling", pooler_config=json.dumps({"pooling_type": mode}),
                         max_num_batched_tokens=16)
    assert engine.runner_type == "pooling"
    ids = [engine.tokenizer.encode_prompt(p) for p in PROMPTS]
    outputs = embed(engine, PROMPTS)
    assert_close(outputs, hf_vectors(BUNDLED_MODEL, ids, mode))
    for out, prompt in zip(outputs, ids):
        assert out.finish_reason == "stop" and out.num_generated_tokens == 0
        assert out.num_prompt_tokens == len(prompt)
    assert engine.pool.num_free == engine.pool.num_blocks  # every block back (evictable cache counts free)


@pytest.mark.parametrize(("arch", "mode", "normalize"), [("qwen3", "LAST", True), ("qwen2", "MEAN", False)])
def test_bare_decoder_checkpoint_is_an_embedding_model(tmp_path, arch, mode, normalize):
    """config.json names Qwen3Model / Qwen2Model: --runner auto pools, with the folder's
    sentence-transformers pooling and normalization."""
    path = save_bare_decoder(tmp_path / arch, arch)
    write_sentence_transformers(path, mode, normalize)
    engine = make_engine(path, max_num_batched_tokens=16)
    assert engine.runner_type == "pooling"
    assert engine.pooler == PoolerConfig(mode, normalize)
    ids = [engine.tokenizer.encode_prompt(p) for p in PROMPTS]
    assert_close(embed(engine, PROMPTS), hf_vectors(path, ids, mode, normalize))


@pytest.mark.parametrize(("tp", "pp", "mode"), [(2, 1, "LAST"), (1, 2, "MEAN")])
def test_tensor_and_pipeline_parallel_ranks_pool_like_transformers(tmp_path, tp, pp, mode):
    """The last stage's TP rank 0 returns the normed hidden rows (whole after the all-reduces); a
    bare decoder's checkpoint is sliced per rank under its unprefixed names."""
    path = save_bare_decoder(tmp_path / "bare", "qwen2")
    write_sentence_transformers(path, mode, normalize=True)
    engine = make_engine(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, max_num_batched_tokens=16,
                         kv_cache_memory=2**20)
    try:
        ids = [engine.tokenizer.encode_prompt(p) for p in PROMPTS]
        assert_close(embed(engine, PROMPTS), hf_vectors(path, ids, mode))
    finally:
        engine.close()


def test_matryoshka_dimensions_and_per_request_normalize(tmp_path):
    path = save_bare_decoder(tmp_path / "m", "llama", matryoshka_dimensions=[16, 32])
    engine = make_engine(path)
    assert engine.pooler.matryoshka_dimensions == (16, 32)
    ids = [engine.tokenizer.encode_prompt(p) for p in PROMPTS[:3]]
    assert_close(embed(engine, PROMPTS[:3], PoolingParams(dimensions=16)), hf_vectors(path, ids, "LAST", dimensions=16))
    assert_close(embed(engine, PROMPTS[:3], PoolingParams(normalize=False)), hf_vectors(path, ids, "LAST", False))
    with pytest.raises(InvalidRequestError, match="supports 16, 32, got 8") as e:
        engine.add_request("x", SamplingParams(pooling=PoolingParams(dimensions=8)), "bad")
    assert e.value.field == "dimensions"
    with pytest.raises(InvalidRequestError, match="at most the model's 64"):
        engine.add_request("x", SamplingParams(pooling=PoolingParams(dimensions=65)), "bad")


def test_dimensions_refused_without_matryoshka():
    engine = make_engine(BUNDLED_MODEL, runner="pooling")
    with pytest.raises(InvalidRequestError, match="not trained for shorter"):
        engine.add_request("x", SamplingParams(pooling=PoolingParams(dimensions=16)), "bad")
    out = embed(engine, ["x"], PoolingParams(dimensions=64))  # the full size is always fine
    assert len(out[0].embedding) == 64


def test_last_token_pooling_uses_the_prefix_cache_mean_does_not():
    prompt = PROMPTS[5]  # 30+ tokens: whole blocks to share
    last = make_engine(BUNDLED_MODEL, runner="pooling")
    first, again = embed(last, [prompt]), embed(last, [prompt])
    assert first[0].num_cached_tokens == 0 and again[0].num_cached_tokens > 0
    assert again[0].embedding == pytest.approx(first[0].embedding, abs=1e-6)
    mean = make_engine(BUNDLED_MODEL, runner="pooling", pooler_config='{"pooling_type": "MEAN"}')
    embed(mean, [prompt])
    assert embed(mean, [prompt])[0].num_cached_tokens == 0  # every position must be computed


def test_accumulate_counts_a_recomputed_position_once():
    """After preemption a prompt's chunks compute again: positions already summed are skipped."""
    seq = type("S", (), {"pool_acc": None, "pool_upto": 0})()
    mean = PoolerConfig("MEAN")
    rows = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    accumulate(mean, [seq], [(0, 0, rows[:4])])
    accumulate(mean, [seq], [(0, 0, rows[:3])])  # recomputed from 0: nothing new
    accumulate(mean, [seq], [(0, 2, rows[2:6])])  # positions 2, 3 again, then 4, 5
    assert seq.pool_acc.tolist() == rows.sum(0).tolist() and seq.pool_upto == 6
    cls = type("S", (), {"pool_acc": None, "pool_upto": 0})()
    accumulate(PoolerConfig("CLS"), [cls], [(0, 0, rows[:2])])
    accumulate(PoolerConfig("CLS"), [cls], [(0, 2, rows[2:4])])
    assert cls.pool_acc.tolist() == rows[0].tolist()


def test_prompt_may_fill_the_context():
    engine = make_engine(BUNDLED_MODEL, runner="pooling", max_model_len=32)
    out = embed(engine, [list(range(3, 35))])
    assert out[0].num_prompt_tokens == 32 and len(out[0].embedding) == 64
    with pytest.raises(PromptTooLongError, match="33 tokens, but the context holds 32"):
        engine.add_request(list(range(3, 36)), SamplingParams(pooling=PoolingParams()), "long")


def test_each_runner_refuses_the_other_kind_of_request():
    pooling = make_engine(BUNDLED_MODEL, runner="pooling")
    with pytest.raises(InvalidRequestError, match="serves embeddings"):
        pooling.add_request("x", SamplingParams(max_tokens=4), "gen")
    with pytest.raises(InvalidRequestError, match="n: not available"):
        pooling.add_request("x", SamplingParams(n=2, pooling=PoolingParams()), "n")
    generate = make_engine(BUNDLED_MODEL)
    assert generate.runner_type == "generate" and generate.pooler is None
    with pytest.raises(InvalidRequestError, match="--runner pooling"):
        generate.add_request("x", SamplingParams(pooling=PoolingParams()), "emb")
    assert not pooling.has_work() and not generate.has_work()


def test_start_up_refusals(tmp_path):
    bare = save_bare_decoder(tmp_path / "bare", "llama")
    with pytest.raises(ModelLoadError, match="LlamaModel, a decoder without an LM head"):
        make_engine(bare, runner="generate")
    with pytest.raises(ValueError, match="does not combine with --async-scheduling"):
        make_engine(bare, async_scheduling=True)
    with pytest.raises(ValueError, match="unknown key\\(s\\) pooling"):
        make_engine(bare, pooler_config='{"pooling": "LAST"}')
    with pytest.raises(ValueError, match="pooling_type must be one of LAST, MEAN, CLS"):
        make_engine(bare, pooler_config='{"pooling_type": "MAX"}')
    with pytest.raises(ValueError, match="--pooler-config needs --runner pooling"):
        make_engine(BUNDLED_MODEL, pooler_config='{"pooling_type": "MEAN"}')
    write_sentence_transformers(bare, "LAST", extra_module="Dense")
    with pytest.raises(ModelLoadError, match="the Dense module is not supported"):
        make_engine(bare)
    write_sentence_transformers(bare, "MAX")
    with pytest.raises(ModelLoadError, match="pooling_mode_max_tokens is not supported"):
        make_engine(bare)


@pytest.mark.parametrize(("arch", "num_labels"), [("qwen2", 3), ("llama", 1)])
def test_sequence_classifier_answers_label_probabilities(tmp_path, arch, num_labels):
    """`*ForSequenceClassification`: --runner auto classifies; the score head's softmax (sigmoid for
    one label) at the last token equals transformers', through chunked prefill."""
    id2label = {str(i): f"class-{i}" for i in range(num_labels)}
    path = save_classifier(tmp_path / arch, arch, num_labels, id2label=id2label)
    engine = make_engine(path, max_num_batched_tokens=16)
    assert engine.runner_type == "pooling" and engine.pooler.task == "classify"
    assert engine.pooler.labels == tuple(id2label.values())
    ids = [engine.tokenizer.encode_prompt(p) for p in PROMPTS]
    assert_close(embed(engine, PROMPTS), hf_class_probs(path, ids))
    with pytest.raises(InvalidRequestError, match="dimensions: not for a classification model"):
        engine.add_request("x", SamplingParams(pooling=PoolingParams(dimensions=2)), "bad")
    with pytest.raises(ModelLoadError, match="serves classifications"):
        make_engine(path, runner="generate")
    with pytest.raises(ValueError, match="does not combine with --tensor-parallel-size > 1"):
        make_engine(path, tensor_parallel_size=2)


def test_lora_adapters_embed_like_peft(tmp_path):
    """An adapter named by the request changes the vectors exactly as PEFT's unmerged adapter does
    (its model's last hidden state is after the final norm, as the pooler's)."""
    from lora_adapters import _peft_model, two_adapters

    adapters = two_adapters(tmp_path, BUNDLED_MODEL)
    engine = make_engine(BUNDLED_MODEL, runner="pooling", lora_modules=[f"{k}={v}" for k, v in adapters.items()],
                         max_num_batched_tokens=16)
    ids = [engine.tokenizer.encode_prompt(p) for p in PROMPTS[:3]]
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(p, SamplingParams(pooling=PoolingParams(), lora="full"), f"full{i}")
        engine.add_request(p, SamplingParams(pooling=PoolingParams()), f"base{i}")
    done = {}
    while engine.has_work():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    peft = _peft_model(str(BUNDLED_MODEL), adapters["full"])
    with torch.no_grad():
        want = [torch.nn.functional.normalize(peft(torch.tensor([x]), output_hidden_states=True).hidden_states[-1][0, -1],
                                              dim=-1) for x in ids]
    assert_close([done[f"full{i}"] for i in range(3)], want)
    assert_close([done[f"base{i}"] for i in range(3)], hf_vectors(BUNDLED_MODEL, ids, "LAST"))
    assert max(abs(a - b) for a, b in zip(done["full0"].embedding, done["base0"].embedding)) > 1e-3
