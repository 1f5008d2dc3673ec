"""Speculative decoding for constrained sequences (structured output): lossless against constrained
decoding without speculation, with n-gram and draft proposals, alone and mixed with unconstrained
sequences; proposals are cut by the grammar, and constrained sequences really speculate."""

from __future__ import annotations

import json
import re
import time

import pytest
from helpers import PROMPTS, make_engine, run_engine, serve
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.structured.spec import GuidedSpec
from test_spec_decode_draft import _perturbed_copy, _truncated_copy

from kvrelay.models import BUNDLED_MODEL

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, "
         "she saw a big, red ball.")
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "w": {"type": "array", "maxItems": 6, "items": {"enum": ["x", "yy"]}}},
          "required": ["name", "n", "w"], "additionalProperties": False}
REGEX = r"(The|A) (cat|dog|bird) (ran|sat|sang)( and (ran|sat|sang)){0,12}\."
CHOICES = ["Once upon a time, there was a little girl named Lily.", "She loved to play outside in the park."]
GUIDED = {"json": GuidedSpec("json", json.dumps(SCHEMA)), "regex": GuidedSpec("regex", REGEX),
          "choice": GuidedSpec("choice", json.dumps(CHOICES))}
NGRAM = {"speculative_method": "ngram", "num_speculative_tokens": 4, "ngram_min": 1,
         "speculative_adaptive": False}  # every step the limits allow: coverage must not depend on timing


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return _truncated_copy(tmp_path_factory.mktemp("draft") / "stories-4l", 4)


def _draft_spec(draft_dir) -> dict:
    return {"speculative_method": "draft", "speculative_model": str(draft_dir), "num_speculative_tokens": 3,
            "speculative_adaptive": False}


def _params(kind: str | None, max_tokens: int = 90, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=kw.pop("temperature", 0.0),
                          structured=GUIDED[kind] if kind else None, **kw)


def _valid(kind: str, engine, ids: list[int]) -> bool:
    assert ids[-1] in engine.eos_ids  # the grammar ended the output
    text = engine.tokenizer.decode(ids[:-1])
    if kind == "json":
        value = json.loads(text)
        return set(value) == {"name", "n", "w"} and set(value["w"]) <= {"x", "yy"}
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    return text in CHOICES


def _mixed_batch() -> dict[str, tuple]:
    """Every grammar kind twice, and unconstrained sequences, prompts quoting the story (lookups hit)."""
    requests = {}
    for i, kind in enumerate(["json", "regex", "choice"] * 2):
        requests[f"{kind}{i}"] = ((STORY + " " + PROMPTS[i]) if i % 2 else PROMPTS[i], _params(kind))
    for i in range(3):
        requests[f"free{i}"] = (STORY + " " + STORY[: 30 + 10 * i], _params(None, 40))
    return requests


def _assert_constrained_speculated(engine, cut: bool) -> None:
    s = engine.speculator.stats
    assert s.num_constrained_drafts > 0 and s.num_constrained_accepted_tokens > 0
    if cut:  # n-gram lookups run into the grammar, so some proposals lose their tail
        assert s.num_grammar_cut_tokens > 0
    else:  # the draft's proposals are masked by the grammar: none is cut
        assert s.num_grammar_cut_tokens == 0
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("kind", ["json", "regex", "choice"])
def test_greedy_constrained_tokens_are_identical_with_ngram_speculation_at_batch_1(kind):
    # The story told with other words: lookups propose them where the choice insists on its own.
    other = STORY.replace("Lily", "Sue").replace("park", "garden")
    requests = {"r": (other + " " + other, _params(kind))}
    want = run_engine(make_engine(BUNDLED_MODEL), requests)
    engine = make_engine(BUNDLED_MODEL, **NGRAM)
    got = run_engine(engine, requests)
    assert got == want
    assert _valid(kind, engine, got["r"])
    _assert_constrained_speculated(engine, cut=True)


@pytest.mark.parametrize("kind", ["json", "regex", "choice"])
def test_greedy_constrained_tokens_are_identical_with_draft_speculation_at_batch_1(draft, kind):
    requests = {"r": (STORY, _params(kind))}
    want = run_engine(make_engine(BUNDLED_MODEL), requests)
    engine = make_engine(BUNDLED_MODEL, **_draft_spec(draft))
    assert run_engine(engine, requests) == want
    _assert_constrained_speculated(engine, cut=False)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_mixed_batch_of_constrained_and_free_sequences_is_identical(draft, method):
    requests = _mixed_batch()
    want = run_engine(make_engine(BUNDLED_MODEL), requests)
    engine = make_engine(BUNDLED_MODEL, **(NGRAM if method == "ngram" else _draft_spec(draft)))
    assert run_engine(engine, requests) == want
    _assert_constrained_speculated(engine, cut=method == "ngram")
    s = engine.speculator.stats
    assert s.num_accepted_tokens > s.num_constrained_accepted_tokens  # the free ones speculated too
    assert s.num_accepted_tokens < s.num_draft_tokens  # and some proposals were rejected


def test_lossless_through_preemption_and_prefix_hits():
    requests = _mixed_batch() | {f"again{k}": (p, params) for k, (p, params) in list(_mixed_batch().items())[:4]}
    kw = {"num_kv_blocks": 24, "max_model_len": 256}
    want = run_engine(make_engine(BUNDLED_MODEL, **kw), requests)
    engine = make_engine(BUNDLED_MODEL, **kw, **NGRAM)
    assert run_engine(engine, requests) == want
    assert engine.scheduler.num_preemptions > 0 and engine.pool.hits > 0
    _assert_constrained_speculated(engine, cut=True)


def test_logprobs_and_stop_conditions_behave_as_without_speculation():
    """The target's logprobs of every emitted token; a stop string inside an accepted run, max_tokens
    inside a run, and the grammar's end (EOS) all end the output where plain decoding does."""
    cases = {
        "logprobs": (STORY + " " + STORY, _params("json", logprobs=3)),
        "stop": (STORY + " " + STORY, _params("choice", stop=["play"])),
        "length": (STORY + " " + STORY, _params("regex", max_tokens=7)),
        "eos": (STORY + " " + STORY, _params("choice")),
    }
    outs = []
    for kw in ({}, NGRAM):
        engine = make_engine(BUNDLED_MODEL, **kw)
        result = {rid: {"text": "", "ids": [], "lps": [], "reason": None} for rid in cases}
        for rid, (prompt, params) in cases.items():
            engine.add_request(prompt, params, rid)
        while engine.has_work():
            for o in engine.step():
                r = result[o.request_id]
                r["text"] += o.text
                r["ids"] += o.new_token_ids
                r["lps"] += o.logprobs or []
                r["reason"] = o.finish_reason or r["reason"]
        outs.append(result)
    plain, spec = outs
    assert engine.speculator.stats.num_constrained_accepted_tokens > 0
    for rid in cases:
        assert (spec[rid]["text"], spec[rid]["ids"], spec[rid]["reason"]) == (
            plain[rid]["text"], plain[rid]["ids"], plain[rid]["reason"]), rid
    assert [r["reason"] for r in spec.values()] == ["stop", "stop", "length", "stop"]
    assert spec["stop"]["text"] == "She loved to " and spec["eos"]["text"] in CHOICES
    want, got = plain["logprobs"]["lps"], spec["logprobs"]["lps"]
    assert len(got) == len(want) == len(spec["logprobs"]["ids"]) > 10
    # Verification scores K+1 rows in one forward where plain decoding scores one: the float32 matmuls
    # accumulate in another order (and with another thread split), so logprobs agree to a few ULP of
    # the logits, not bit for bit (1.05e-5 apart at -9.4 was seen in CI). Token choice must not move.
    for a, b in zip(got, want):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_seeded_constrained_sampling_is_the_same_alone_and_in_a_busy_batch(draft, method):
    spec = NGRAM if method == "ngram" else _draft_spec(draft)
    mine = {k: (STORY + " " + STORY, _params(k, temperature=0.8, seed=7 + i)) for i, k in enumerate(GUIDED)}
    alone = {k: run_engine(make_engine(BUNDLED_MODEL, **spec), {k: r})[k] for k, r in mine.items()}
    busy = make_engine(BUNDLED_MODEL, **spec)
    others = {f"o{i}": (p, _params([None, "json", "regex"][i % 3], 40, temperature=1.0, seed=i))
              for i, p in enumerate(PROMPTS)}
    got = run_engine(busy, {**others, **mine})
    assert {k: got[k] for k in mine} == alone
    for kind in mine:
        assert _valid(kind, busy, got[kind])
    assert busy.speculator.stats.num_constrained_accepted_tokens > 0


def test_random_tiny_model_constrained_greedy_is_identical(tiny_models, tmp_path):
    """A random model and a perturbed copy as its draft: rejections by the target, and the grammar's
    mask on every row the target and the draft score."""
    model = tiny_models["llama"]
    draft_dir = _perturbed_copy(model, tmp_path / "draft", 0.05)
    requests = {k: (list(range(3 + i, 40)) * 2, _params(k, 24)) for i, k in enumerate(GUIDED)}
    requests["free"] = (list(range(3, 40)) * 2, _params(None, 24))
    want = run_engine(make_engine(model), requests)
    for spec in (NGRAM, _draft_spec(draft_dir)):
        engine = make_engine(model, **spec)
        assert run_engine(engine, requests) == want, spec["speculative_method"]
        assert engine.speculator.stats.num_constrained_drafts > 0
    # The draft, a near copy, guesses the random target's constrained tokens.
    assert engine.speculator.stats.num_constrained_accepted_tokens > 0


def test_serve_speculates_for_json_schema_requests(tmp_path):
    """`kvrelay serve --speculative-method ngram` through real HTTP and the openai client:
    response_format json_schema output equals the plain engine's, and speculation happened."""
    import httpx
    import jsonschema
    import openai

    with serve(tmp_path / "serve.log", "--speculative-method", "ngram", "--num-speculative-tokens", "4",
               "--ngram-min", "1", "--no-speculative-adaptive") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        response_format = {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA, "strict": True}}
        prompt = STORY + " " + STORY
        got = client.completions.create(model="stories260K", prompt=prompt, max_tokens=90, temperature=0,
                                        extra_body={"response_format": response_format})
        engine = make_engine(BUNDLED_MODEL)
        engine.add_request(prompt, _params("json"), "r")
        want = ""
        while engine.has_work():
            want += "".join(o.text for o in engine.step())
        assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
        chat = client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": STORY}],
                                              response_format=response_format, max_tokens=90, temperature=0)
        assert chat.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)

        def spec_metrics() -> dict[str, float]:
            metrics = {}
            for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
                if line.startswith("kvrelay:spec_decode_num_"):
                    name, value = line.rsplit(" ", 1)
                    metrics[name.split("{")[0]] = float(value)
            return metrics

        # Only constrained requests ran: their proposals were drafted and accepted. The engine process
        # reports its counters every few hundred ms: poll.
        deadline = time.monotonic() + 30
        while (metrics := spec_metrics()).get("kvrelay:spec_decode_num_constrained_accepted_tokens_total", 0) == 0:
            assert time.monotonic() < deadline, metrics
            time.sleep(0.1)
        assert metrics["kvrelay:spec_decode_num_drafts_total"] > 0
        assert metrics["kvrelay:spec_decode_num_accepted_tokens_total"] > 0
        assert metrics["kvrelay:spec_decode_num_constrained_drafts_total"] == metrics["kvrelay:spec_decode_num_drafts_total"]
        assert "kvrelay:spec_decode_num_grammar_cut_tokens_total" in metrics


def test_constrained_sampled_outputs_have_the_same_distribution(tiny_models):
    """Rejection sampling under the mask is lossless: on a tiny random model at temperature 1.5, the
    outputs of a three-letter regex with n-gram speculation against without (chi-square on the
    contingency table of outcomes). The prompt repeats the letters, so lookups propose them."""
    import collections

    from scipy.stats import chi2_contingency

    model = tiny_models["llama"]
    vocab = make_engine(model).tokenizer.vocab()
    prompt = [vocab[c] for c in "abc"] * 40
    regex = GuidedSpec("regex", "(a|b|c)(a|b|c)(a|b|c)")
    counts = []
    for kw in ({}, NGRAM | {"speculative_disable_batch_size": 10_000}):
        engine = make_engine(model, max_num_seqs=256, **kw)
        outs: dict[tuple, list] = collections.defaultdict(list)
        for r in range(40):
            params = SamplingParams(max_tokens=4, temperature=1.5, seed=1000 * r, n=16, structured=regex)
            engine.add_request(prompt, params, f"r{r}")
        while engine.has_work():
            for o in engine.step():
                outs[(o.request_id, o.index)] += o.new_token_ids
        counts.append(collections.Counter(engine.tokenizer.decode(v) for v in outs.values()))
        if kw:
            s = engine.speculator.stats
            assert s.num_constrained_drafts > 40 and 0 < s.num_constrained_accepted_tokens < s.num_draft_tokens
    assert all(re.fullmatch("[abc]{3}", text) for c in counts for text in c)
    keys = sorted(set(counts[0]) | set(counts[1]), key=lambda k: -(counts[0][k] + counts[1][k]))
    common = [k for k in keys if counts[0][k] + counts[1][k] >= 10]  # chi-square needs populated cells
    table = [[c[k] for k in common] + [sum(c.values()) - sum(c[k] for k in common)] for c in counts]
    _, p_value, _, _ = chi2_contingency(table)
    assert p_value > 1e-3, (p_value, table)
