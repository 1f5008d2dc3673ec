"""Speculative decoding (n-gram prompt lookup): lossless by test, in every scheduling condition."""

from __future__ import annotations

import collections

import pytest
from helpers import PROMPTS, greedy, make_engine, run_engine
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.spec_decode.ngram import NgramProposer

from kvrelay.models import BUNDLED_MODEL

STORY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day, "
         "she saw a big, red ball.")
# Prompts that quote a passage and start it again: the continuation repeats it, so lookups hit.
REPEATING = [STORY + " " + STORY[:40], STORY[40:] + " " + STORY[40:90]]
SPEC = {"speculative_method": "ngram", "num_speculative_tokens": 4, "ngram_min": 1,  # more drafts to check
        "speculative_adaptive": False}  # every step the limits allow: coverage must not depend on timing


def _both(model, prompts, n_tokens, **kw):
    requests = {str(i): (p, greedy(n_tokens)) for i, p in enumerate(prompts)}
    plain = make_engine(model, **kw)
    spec = make_engine(model, **kw, **SPEC)
    return run_engine(plain, requests), run_engine(spec, requests), spec


def _assert_lossless_with_real_rejections(model, prompts, n_tokens, **kw):
    want, got, spec = _both(model, prompts, n_tokens, **kw)
    assert got == want
    s = spec.speculator.stats
    assert s.num_drafts > 0 and 0 < s.num_accepted_tokens < s.num_draft_tokens  # some of each
    assert spec.pool.num_free == spec.pool.num_blocks
    return s


@pytest.mark.parametrize("batch", [1, 16])
def test_greedy_tokens_are_identical_with_speculation(batch):
    prompts = [(REPEATING + PROMPTS)[i % 8] for i in range(batch)]
    _assert_lossless_with_real_rejections(BUNDLED_MODEL, prompts, 40)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_tokens_are_identical_on_random_tiny_models(tiny_models, arch):
    prompts = [list(range(3, 40)) * 2, [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]  # token ids that repeat
    want, got, spec = _both(tiny_models[arch], prompts, 32)
    assert got == want and spec.speculator.stats.num_drafts > 0


def test_lossless_through_chunked_prefill_and_prefix_hits():
    prompts = REPEATING * 3 + PROMPTS[:4]  # repeats: prefix-cache hits
    # A 7-token budget chunks prompts, and caps how many tokens a step can propose.
    want, got, spec = _both(BUNDLED_MODEL, prompts, 48, max_num_batched_tokens=7)
    assert got == want
    assert spec.speculator.stats.num_accepted_tokens > 0 and spec.pool.hits > 0


def test_lossless_through_preemption():
    prompts = REPEATING * 2 + PROMPTS
    want, got, spec = _both(BUNDLED_MODEL, prompts, 64, num_kv_blocks=36, max_model_len=256)
    assert got == want
    assert spec.speculator.stats.num_accepted_tokens > 0 and spec.scheduler.num_preemptions > 0


def test_stop_string_and_max_tokens_inside_an_accepted_run_end_where_they_would():
    stop = SamplingParams(max_tokens=60, temperature=0.0, stop=["park"])
    length = SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True)
    for params in (stop, length):
        outs = []
        for kw in ({}, SPEC):
            engine = make_engine(BUNDLED_MODEL, **kw)
            engine.add_request(REPEATING[0], params, "r")
            text, ids, reason = "", [], None
            while engine.has_work():
                for o in engine.step():
                    text, ids, reason = text + o.text, ids + o.new_token_ids, o.finish_reason
            outs.append((text, ids, reason))
        assert outs[0] == outs[1]
    assert outs[1][2] == "length" and len(outs[1][1]) == 13


def test_context_limit_inside_a_run_and_a_prompt_at_max_model_len_minus_k():
    engine = make_engine(BUNDLED_MODEL, max_model_len=64)
    ids = engine.tokenizer.encode_prompt(STORY)[:30]
    prompt = ids + ids[:64 - 4 - 30]  # 60 tokens: max_model_len - K
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)  # what the context leaves
    want = run_engine(engine, {"r": (prompt, params)})
    spec = make_engine(BUNDLED_MODEL, max_model_len=64, **SPEC)
    got = run_engine(spec, {"r": (prompt, params)})
    assert got == want and len(got["r"]) == 4
    long = ids + ids
    assert run_engine(spec, {"l": (long, params)}) == run_engine(engine, {"l": (long, params)})


def test_seeded_sampling_is_the_same_alone_and_in_a_busy_batch():
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=11)
    alone = make_engine(BUNDLED_MODEL, **SPEC)
    want = run_engine(alone, {"s": (REPEATING[0], params)})
    busy = make_engine(BUNDLED_MODEL, **SPEC)
    others = {f"o{i}": (p, SamplingParams(max_tokens=25, temperature=1.0, seed=i)) for i, p in enumerate(PROMPTS)}
    got = run_engine(busy, {**others, "s": (REPEATING[0], params)})
    assert got["s"] == want["s"]
    assert busy.speculator.stats.num_drafts > 0


def test_the_verification_rule_keeps_the_target_distribution():
    """Accept d with probability p(d), else draw from p without d: each emitted token ~ p exactly.
    Goodness of fit against the exact target distribution over 5,000 seeded trials."""
    import random

    import torch
    from kvrelay.engine.sequence import Sequence
    from kvrelay.engine.spec_decode.verify import verify
    from scipy.stats import chisquare

    torch.manual_seed(0)
    logits = torch.randn(3, 6) * 1.5
    params = SamplingParams(temperature=0.7, top_k=5)
    seq = Sequence(seq_id=0, request_id="r", index=0, token_ids=[1], prompt_len=1, params=params, priority=0,
                   max_tokens=9, detok=None, metrics=None)
    proposal = [int(logits[0].argmax()), 4]  # a likely and a less likely guess
    first, second = collections.Counter(), collections.Counter()
    for trial in range(5_000):
        seq.rng = random.Random(trial)
        emitted, _ = verify(seq, logits.clone(), proposal)
        first[emitted[0]] += 1
        if emitted[0] == proposal[0]:
            second[emitted[1]] += 1
    for counter, row in ((first, logits[0]), (second, logits[1])):
        scaled = row / 0.7
        scaled[scaled < scaled.topk(5).values[-1]] = float("-inf")  # top_k=5, as the sampler filters
        p = scaled.double().softmax(-1)
        support = [t for t in range(6) if p[t] > 0]
        total = sum(counter.values())
        assert set(counter) <= set(support)
        expected = [float(p[t]) for t in support]
        expected = [e * total / sum(expected) for e in expected]  # sums to total in float64
        _, p_value = chisquare([counter[t] for t in support], expected)
        assert p_value > 1e-3, (counter, p)


def test_sampled_continuations_have_the_same_distribution(tiny_models):
    """End to end on a tiny model: the second and third sampled tokens, with and without speculation
    (chi-square on the contingency table of outcomes)."""
    from scipy.stats import chi2_contingency

    prompt = list(range(3, 300))  # most first tokens occur in the prompt: the lookup proposes
    counts = []
    for kw in ({}, SPEC | {"speculative_disable_batch_size": 10_000}):
        engine = make_engine(tiny_models["llama"], max_num_seqs=256, **kw)
        outs: dict[tuple, list] = collections.defaultdict(list)
        for r in range(60):
            params = SamplingParams(max_tokens=3, temperature=1.5, seed=1000 * r, n=16, ignore_eos=True)
            engine.add_request(prompt, params, f"r{r}")
        while engine.has_work():
            for o in engine.step():
                outs[(o.request_id, o.index)] += o.new_token_ids
        counts.append(collections.Counter(tuple(v[1:]) for v in outs.values()))
        if kw:
            assert engine.speculator.stats.num_drafts > 50
    keys = sorted(set(counts[0]) | set(counts[1]), key=lambda k: -(counts[0][k] + counts[1][k]))
    common = [k for k in keys if counts[0][k] + counts[1][k] >= 10]  # chi-square needs populated cells
    table = [[c[k] for k in common] + [sum(c.values()) - sum(c[k] for k in common)] for c in counts]
    _, p_value, _, _ = chi2_contingency(table)
    assert p_value > 1e-3, (p_value, table)


def test_a_full_batch_does_not_speculate():
    drafts = []
    for limit in (4, 8):  # 8 running sequences: above the first limit, at the second
        engine = make_engine(BUNDLED_MODEL, speculative_disable_batch_size=limit, **SPEC)
        for i in range(8):
            engine.add_request(REPEATING[i % 2], greedy(20), str(i))
        for _ in range(6):
            engine.step()
        drafts.append(engine.speculator.stats.num_drafts)
    assert drafts[0] == 0 and drafts[1] > 0


@pytest.mark.parametrize("kw,match", [
    ({"num_speculative_tokens": 0}, "between 1 and 16"),
    ({"num_speculative_tokens": 17}, "between 1 and 16"),
    ({"speculative_method": "eagle"}, "must be one of"),
    ({"ngram_min": 3, "ngram_max": 2}, "ngram-min"),
])
def test_bad_settings_fail_at_start_with_one_clear_error(kw, match):
    with pytest.raises(ValueError, match=match):
        make_engine(BUNDLED_MODEL, **(SPEC | kw))


def test_ngram_lookup_takes_the_latest_longest_match():
    p = NgramProposer(1, 3)
    assert p.propose([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 2) == [8, 1]  # latest "1 2 3"
    assert p.propose([5, 6, 7, 5, 6, 9, 6], 3) == [9, 6]  # only "6" recurs; what follows runs out
    assert p.propose([1, 2, 3], 3) == []
    assert p.propose([256, 1, 256], 1) == [1]  # ids whose bytes overlap other ids still align
    assert NgramProposer(2, 2).propose([1, 2, 3, 4, 2], 2) == []


def test_counters_reach_the_engine_stats_and_the_workers_metrics():
    from kvrelay.kvtransfer.metrics import WorkerMetrics
    from prometheus_client import generate_latest

    engine = make_engine(BUNDLED_MODEL, **SPEC)
    run_engine(engine, {"r": (REPEATING[0], greedy(24))})
    s = engine.stats()
    assert s.spec_num_drafts > 0 and s.spec_num_draft_tokens >= s.spec_num_accepted_tokens > 0
    assert sum(s.spec_accepted_per_position) == s.spec_num_accepted_tokens
    text = generate_latest(WorkerMetrics(engine).registry).decode()
    assert f"kvrelay:spec_decode_num_drafts_total {float(s.spec_num_drafts)}" in text
    assert 'kvrelay:spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in text
    assert "spec_decode" not in generate_latest(WorkerMetrics(make_engine(BUNDLED_MODEL)).registry).decode()


def test_the_controller_runs_the_faster_mode_and_keeps_exploring():
    from kvrelay.engine.spec_decode.controller import MIN_SAMPLES, SpecController, explore_every

    c = SpecController()
    for _ in range(MIN_SAMPLES):  # nothing measured: speculation first
        assert c.should_speculate(16)
        c.record(16, True, tokens=40, seconds=0.01)  # 4,000 tok/s speculating
    for _ in range(MIN_SAMPLES):  # then plain, to compare
        assert not c.should_speculate(16)
        c.record(16, False, tokens=16, seconds=0.002)  # 8,000 tok/s plain: plain wins
    assert explore_every(0.5) == 50 and explore_every(0.875) == 13 and explore_every(0.99) == 8
    choices = [c.should_speculate(16) for _ in range(4 * 50)]
    assert choices.count(True) == 4  # half the rate: one exploring step in 50 (costs 1% of throughput)
    close = SpecController()
    for mode, tokens in ((True, 70), (False, 80)):  # 7,000 against 8,000 tok/s
        for _ in range(MIN_SAMPLES):
            close.record(16, mode, tokens=tokens, seconds=0.01)
    choices = [close.should_speculate(16) for _ in range(4 * 13)]
    assert choices.count(True) == 4  # 7/8 of the rate: one in 13
    assert c.preferred(16) is False and c.preferred(1) is True  # batch 1 is measured on its own
    for _ in range(10):  # the workload changes: speculation now wins
        c.record(16, True, tokens=80, seconds=0.005)
    assert c.preferred(16) is True
    c.record(16, False, tokens=1, seconds=10.0)  # one stalled step moves a median little
    assert c.rates()[16][False] > 1000


def test_seeded_tokens_do_not_depend_on_batch_level_decisions():
    """The batch-size limit turns speculation off for the batch, not for a seeded sequence: its
    random stream would otherwise be consumed differently in a busy batch."""
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=5)
    want = run_engine(make_engine(BUNDLED_MODEL, **SPEC), {"s": (REPEATING[0], params)})
    busy = make_engine(BUNDLED_MODEL, **(SPEC | {"speculative_disable_batch_size": 2}))
    others = {f"o{i}": (p, greedy(25)) for i, p in enumerate(PROMPTS)}
    assert run_engine(busy, {**others, "s": (REPEATING[0], params)})["s"] == want["s"]


def test_min_tokens_ban_holds_inside_accepted_runs():
    free = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ids = run_engine(make_engine(BUNDLED_MODEL), {"r": (REPEATING[0], free)})["r"]
    stop = max(set(ids[1:]), key=ids.count)  # a token the repeating text keeps choosing
    held = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop_token_ids=[stop], min_tokens=20)
    plain = run_engine(make_engine(BUNDLED_MODEL), {"r": (REPEATING[0], held)})["r"]
    spec = make_engine(BUNDLED_MODEL, **SPEC)
    assert run_engine(spec, {"r": (REPEATING[0], held)})["r"] == plain
    assert stop not in plain[:20] and spec.speculator.stats.num_accepted_tokens > 0
