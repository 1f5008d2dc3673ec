"""Speculative decoding with a draft model: lossless against the plain engine, with real rejections."""

from __future__ import annotations

import json
import shutil
import time

import pytest
from helpers import PROMPTS, greedy, make_engine, run_engine, serve
from kvrelay.engine.errors import ModelLoadError
from kvrelay.engine.sampling_params import SamplingParams
from safetensors.torch import load_file, save_file

from kvrelay.models import BUNDLED_MODEL

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, "
         "she saw a big, red ball.")


def _truncated_copy(dst, num_layers: int):
    """stories260K cut to its first layers: same vocabulary, other (worse) predictions."""
    shutil.copytree(BUNDLED_MODEL, dst)
    config = json.loads((dst / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(dst / "model.safetensors")
    keep = {k: v for k, v in tensors.items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers}
    save_file(keep, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return _truncated_copy(tmp_path_factory.mktemp("draft") / "stories-4l", 4)  # 4 of 5: accepts some


def _spec(draft_dir, **kw):
    return {"speculative_method": "draft", "speculative_model": str(draft_dir), "num_speculative_tokens": 3,
            "speculative_adaptive": False} | kw


@pytest.mark.parametrize("batch", [1, 16])
def test_greedy_tokens_are_identical_with_a_draft_that_differs(draft, batch):
    requests = {str(i): ((PROMPTS + [STORY])[i % 5], greedy(32)) for i in range(batch)}
    want = run_engine(make_engine(BUNDLED_MODEL), requests)
    engine = make_engine(BUNDLED_MODEL, **_spec(draft))
    assert run_engine(engine, requests) == want
    s = engine.speculator.stats
    assert s.num_drafts > 0 and 0 < s.num_accepted_tokens < s.num_draft_tokens  # accepted and rejected
    assert engine.pool.num_free == engine.pool.num_blocks


def test_the_target_as_its_own_draft_accepts_everything():
    requests = {"a": (STORY, greedy(24)), "b": (PROMPTS[0], greedy(24))}
    engine = make_engine(BUNDLED_MODEL, **_spec(BUNDLED_MODEL))
    assert run_engine(engine, requests) == run_engine(make_engine(BUNDLED_MODEL), requests)
    s = engine.speculator.stats
    assert s.num_draft_tokens > 0 and s.num_accepted_tokens == s.num_draft_tokens


def test_lossless_through_chunked_prefill_prefix_hits_and_preemption(draft):
    prompts = [STORY] * 3 + PROMPTS
    requests = {str(i): (p, greedy(40)) for i, p in enumerate(prompts)}
    for kw in ({"max_num_batched_tokens": 7}, {"num_kv_blocks": 20, "max_model_len": 256}):
        want = run_engine(make_engine(BUNDLED_MODEL, **kw), requests)
        engine = make_engine(BUNDLED_MODEL, **kw, **_spec(draft))
        assert run_engine(engine, requests) == want, kw
        assert engine.speculator.stats.num_accepted_tokens > 0
        assert engine.pool.num_free == engine.pool.num_blocks
    assert engine.scheduler.num_preemptions > 0


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch(draft):
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=11)
    want = run_engine(make_engine(BUNDLED_MODEL, **_spec(draft)), {"s": (STORY, params)})
    busy = make_engine(BUNDLED_MODEL, **_spec(draft))
    others = {f"o{i}": (p, SamplingParams(max_tokens=25, temperature=1.0, seed=i)) for i, p in enumerate(PROMPTS)}
    assert run_engine(busy, {**others, "s": (STORY, params)})["s"] == want["s"]
    assert busy.speculator.stats.num_drafts > 0


def test_a_draft_with_another_vocabulary_or_no_model_fails_at_start(tmp_path, draft):
    other = shutil.copytree(draft, tmp_path / "other-vocab")
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] = 1024
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="vocabulary has 1024 tokens, the target's 512"):
        make_engine(BUNDLED_MODEL, **_spec(other))
    retok = shutil.copytree(draft, tmp_path / "other-tokenizer")
    tok = json.loads((retok / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (retok / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ModelLoadError, match="tokenizer maps tokens to other ids"):
        make_engine(BUNDLED_MODEL, **_spec(retok))
    with pytest.raises(ValueError, match="needs --speculative-model"):
        make_engine(BUNDLED_MODEL, speculative_method="draft")
    with pytest.raises(ValueError, match="draft only"):
        make_engine(BUNDLED_MODEL, speculative_method="ngram", speculative_model=str(draft))
    with pytest.raises(ModelLoadError, match="model folder not found"):
        make_engine(BUNDLED_MODEL, **_spec(tmp_path / "missing"))


def test_serve_speculates_with_a_draft_and_exports_its_counters(draft, tmp_path):
    """`kvrelay serve --speculative-method draft` through real HTTP and the openai client: the same
    text as the plain engine, and the kvrelay:spec_decode_* counters on /metrics."""

    import httpx
    import openai

    with serve(tmp_path / "serve.log", "--speculative-method", "draft", "--speculative-model", str(draft),
               "--num-speculative-tokens", "3") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        got = client.completions.create(model="stories260K", prompt=STORY, max_tokens=24, temperature=0)
        engine = make_engine(BUNDLED_MODEL)
        engine.add_request(STORY, SamplingParams(max_tokens=24, temperature=0.0), "r")
        want = ""
        while engine.has_work():
            want += "".join(o.text for o in engine.step())
        assert got.choices[0].text == want
        # The engine process pushes its counters to the API process every 0.1 s: poll for them.
        deadline, drafts = time.monotonic() + 30, []
        while not (drafts and drafts[0] > 0) and time.monotonic() < deadline:
            time.sleep(0.1)
            lines = httpx.get(url + "/metrics", timeout=10).text.splitlines()
            drafts = [float(x.rsplit(" ", 1)[1]) for x in lines
                      if x.startswith("kvrelay:spec_decode_num_drafts_total")]
        assert drafts and drafts[0] > 0


def _perturbed_copy(src, dst, scale: float):
    """src with noise on every weight: the same shapes and vocabulary, other predictions now and then."""
    import torch

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    noisy = {k: v + scale * v.std() * torch.randn(v.shape, generator=gen) if v.ndim == 2 else v
             for k, v in tensors.items()}
    save_file(noisy, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_tokens_are_identical_on_random_tiny_models(tiny_models, tmp_path, arch):
    draft = _perturbed_copy(tiny_models[arch], tmp_path / "draft", 0.05)
    prompts = [list(range(3, 40)), [5, 6, 7, 8, 9], list(range(100, 180))]
    requests = {str(i): (p, greedy(32)) for i, p in enumerate(prompts * 3)}
    want = run_engine(make_engine(tiny_models[arch]), requests)
    engine = make_engine(tiny_models[arch], **_spec(draft))
    assert run_engine(engine, requests) == want
    s = engine.speculator.stats
    assert 0 < s.num_accepted_tokens < s.num_draft_tokens


def test_sampled_continuations_have_the_same_distribution(tiny_models, tmp_path):
    """Second and third sampled tokens with a draft against plain sampling: chi-square on the
    contingency table of outcomes (the draft's greedy proposals are a one-hot q)."""
    import collections

    from scipy.stats import chi2_contingency

    draft = _perturbed_copy(tiny_models["llama"], tmp_path / "draft", 0.3)
    prompt = list(range(3, 60))
    counts = []
    for kw in ({}, _spec(draft, speculative_disable_batch_size=10_000)):
        engine = make_engine(tiny_models["llama"], max_num_seqs=256, **kw)
        outs: dict[tuple, list] = collections.defaultdict(list)
        for r in range(50):
            params = SamplingParams(max_tokens=3, temperature=1.5, seed=1000 * r, n=16, ignore_eos=True)
            engine.add_request(prompt, params, f"r{r}")
        while engine.has_work():
            for o in engine.step():
                outs[(o.request_id, o.index)] += o.new_token_ids
        counts.append(collections.Counter(tuple(v[1:]) for v in outs.values()))
        if kw:
            s = engine.speculator.stats
            assert s.num_drafts > 50 and 0 < s.num_accepted_tokens < s.num_draft_tokens
    keys = sorted(set(counts[0]) | set(counts[1]), key=lambda k: -(counts[0][k] + counts[1][k]))
    common = [k for k in keys if counts[0][k] + counts[1][k] >= 10]
    table = [[c[k] for k in common] + [sum(c.values()) - sum(c[k] for k in common)] for c in counts]
    _, p_value, _, _ = chi2_contingency(table)
    assert p_value > 1e-3, (p_value, table)
