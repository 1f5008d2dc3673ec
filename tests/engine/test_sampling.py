"""Sampling: seeds independent of the batch, filters, penalties, stop strings, logprobs, n > 1."""

from __future__ import annotations

import random

import numpy as np
import torch
from helpers import PROMPTS, make_engine, run_engine
from kvrelay.engine.async_scheduling import PENDING
from kvrelay.engine.sampler import Penalties, _draw, penalize, penalties_of, sample
from kvrelay.engine.sampling_params import SamplingParams

from kvrelay.models import BUNDLED_MODEL


def sampled(seed, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=40, temperature=1.0, seed=seed, **kw)


def test_same_seed_same_tokens_alone_and_in_a_busy_batch():
    alone = run_engine(make_engine(BUNDLED_MODEL), {"x": ("Once upon a time", sampled(42))})["x"]
    busy = {f"noise{i}": (PROMPTS[i % len(PROMPTS)], sampled(None)) for i in range(12)}
    busy["x"] = ("Once upon a time", sampled(42))
    in_batch = run_engine(make_engine(BUNDLED_MODEL, max_num_batched_tokens=16), busy)["x"]
    assert alone == in_batch
    other_seed = run_engine(make_engine(BUNDLED_MODEL), {"x": ("Once upon a time", sampled(43))})["x"]
    assert other_seed != alone


def test_unseeded_requests_differ():
    engine = make_engine(BUNDLED_MODEL)
    out = run_engine(engine, {str(i): ("Once upon a time", sampled(None)) for i in range(4)})
    assert len({tuple(v) for v in out.values()}) > 1


def test_top_k_1_and_tiny_top_p_are_greedy():
    engine = make_engine(BUNDLED_MODEL)
    out = run_engine(
        engine,
        {
            "greedy": ("Lily", SamplingParams(max_tokens=40, temperature=0.0)),
            "k1": ("Lily", sampled(1, top_k=1)),
            "p": ("Lily", sampled(2, top_p=1e-6)),
            "minp": ("Lily", sampled(3, min_p=1.0)),
        },
    )
    assert out["k1"] == out["greedy"] == out["p"] == out["minp"]


def test_penalties_change_the_output_and_reduce_repeats():
    engine = make_engine(BUNDLED_MODEL)
    base = SamplingParams(max_tokens=60, temperature=0.0)
    out = run_engine(
        engine,
        {
            "plain": ("Once upon a time", base),
            "freq": (
                "Once upon a time",
                SamplingParams(max_tokens=60, temperature=0.0, frequency_penalty=2.0),
            ),
            "rep": (
                "Once upon a time",
                SamplingParams(max_tokens=60, temperature=0.0, repetition_penalty=2.0),
            ),
            "pres": (
                "Once upon a time",
                SamplingParams(max_tokens=60, temperature=0.0, presence_penalty=2.0),
            ),
        },
    )

    def repeats(ids):
        return len(ids) - len(set(ids))

    for name in ("freq", "rep", "pres"):
        assert out[name] != out["plain"]
        assert repeats(out[name]) < repeats(out["plain"])


def _collect(engine, prompt, params, rid="r"):
    engine.add_request(prompt, params, rid)
    outs = []
    while engine.has_work():
        outs += engine.step()
    return outs


def test_stop_string_across_token_boundaries_is_never_emitted():
    engine = make_engine(BUNDLED_MODEL)
    full = "".join(
        o.text for o in _collect(engine, "Once upon a time", SamplingParams(max_tokens=40, temperature=0))
    )
    # "girl named" spans the tokens "▁girl" and "▁named" (and the space between them).
    stop = "rl nam"
    assert stop in full
    outs = _collect(
        engine, "Once upon a time", SamplingParams(max_tokens=40, temperature=0, stop=[stop]), "s"
    )
    text = "".join(o.text for o in outs)
    assert text == full[: full.index(stop)]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    for o in outs:  # no delta ever leaked a piece of the stop string past the cut
        assert stop not in o.text


def test_stop_token_ids_and_max_tokens_finish_reasons():
    engine = make_engine(BUNDLED_MODEL)
    ids = [
        i
        for o in _collect(engine, "Lily", SamplingParams(max_tokens=20, temperature=0))
        for i in o.new_token_ids
    ]
    outs = _collect(
        engine, "Lily", SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[ids[5]]), "t"
    )
    assert [i for o in outs for i in o.new_token_ids] == ids[: ids.index(ids[5]) + 1]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == ids[5]
    outs = _collect(engine, "Lily", SamplingParams(max_tokens=7, temperature=0), "u")
    assert outs[-1].finish_reason == "length" and outs[-1].num_generated_tokens == 7


def test_n_samples_share_prompt_blocks_and_differ():
    engine = make_engine(BUNDLED_MODEL)
    prompt = PROMPTS[5]  # > 1 block
    engine.add_request(prompt, SamplingParams(n=4, max_tokens=20, temperature=1.0, seed=9), "n")
    texts = {i: [] for i in range(4)}
    finished = set()
    while engine.has_work():
        for o in engine.step():
            texts[o.index] += o.new_token_ids
            if o.finish_reason:
                finished.add(o.index)
    assert finished == {0, 1, 2, 3}
    assert len({tuple(t) for t in texts.values()}) > 1
    # Samples 1..3 reused sample 0's full prompt blocks from the prefix cache.
    prompt_len = len(engine.tokenizer.encode_prompt(prompt))
    assert engine.stats().prefix_cache_hits >= 3 * (prompt_len // 16) * 16 > 0
    assert engine.pool.num_free == engine.pool.num_blocks


def test_logprobs_have_top_alternatives_sorted():
    engine = make_engine(BUNDLED_MODEL)
    outs = _collect(engine, "Lily", SamplingParams(max_tokens=5, temperature=0.0, logprobs=3))
    for o in outs:
        lp = o.logprobs[0]
        assert lp.token_id == o.new_token_ids[0]
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy picks the best
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)


def test_ignore_eos_still_honours_stop_token_ids():
    engine = make_engine(BUNDLED_MODEL)
    ids = [
        i
        for o in _collect(engine, "Lily", SamplingParams(max_tokens=20, temperature=0))
        for i in o.new_token_ids
    ]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=[ids[4]])
    outs = _collect(engine, "Lily", params, "ie")
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == ids[4]


def test_logit_bias_forces_and_bans_tokens():
    engine = make_engine(BUNDLED_MODEL)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = run_engine(engine, {"x": ("Once upon a time", greedy)})["x"]
    forced = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias={300: 100.0})
    banned = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias={plain[0]: -100.0})
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True, logit_bias={300: 100.0})
    out = run_engine(engine, {"forced": ("Once upon a time", forced), "banned": ("Once upon a time", banned),
                              "seeded": ("Once upon a time", seeded)})
    assert out["forced"] == [300] * 12 and out["seeded"] == [300] * 12
    assert out["banned"][0] != plain[0] and plain[0] not in out["banned"]


def test_greedy_takes_the_first_of_tied_maxima():
    engine = make_engine(BUNDLED_MODEL)
    engine.add_request("Once upon a time", SamplingParams(max_tokens=4, temperature=0.0), "tie")
    (seq,) = engine.requests["tie"]
    vocab = engine.config.vocab_size
    logits = torch.zeros(3, vocab)
    logits[0, [7, 300, 301]] = 5.0  # a three-way tie at the top
    logits[1, -1] = 1.0  # the last column alone
    logits[2, [2, 3]] = float("inf")
    tokens, _ = sample(logits, [seq, seq, seq])
    assert tokens == [7, vocab - 1, 2]


def test_draws_follow_the_distribution_and_skip_filtered_tokens():
    # Inverse-CDF draws: frequencies match the probabilities; zero-probability tokens (as top-k and
    # top-p leave them) never come out, even for uniforms at the very ends of [0, 1).
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]])
    rng = random.Random(0)
    n = 20000
    counts = torch.zeros(6)
    for u in (rng.random() for _ in range(n)):
        counts[_draw(probs, [u])[0]] += 1
    assert counts[[0, 2, 5]].sum() == 0
    assert torch.allclose(counts / n, probs[0], atol=0.015)
    edges = _draw(probs.expand(3, 6), [0.0, 0.5, 1.0 - 2**-53])
    assert edges.tolist() == [1, 3, 4]
    unnormalised = torch.tensor([[0.0, 2.0, 0.0, 0.0]])  # rounding can leave u * total at total
    assert _draw(unnormalised, [1.0]).tolist() == [1]


def test_min_tokens_bans_stop_ids_until_reached():
    engine = make_engine(BUNDLED_MODEL)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = run_engine(engine, {"x": ("Once upon a time", greedy)})["x"]
    stop = plain[0]  # the first greedy token: without the ban the request stops at once
    early = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    held = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop], min_tokens=4)
    out = run_engine(engine, {"early": ("Once upon a time", early), "held": ("Once upon a time", held)})
    assert out["early"] == [stop]
    assert len(out["held"]) >= 4 and stop not in out["held"][:4]


def test_penalties_count_a_token_still_on_the_device_as_one_on_the_host():
    """Async scheduling samples with the previous token still on the device (PENDING on the host):
    every penalty must count it exactly as it counts a token the host has."""
    engine = make_engine(BUNDLED_MODEL)
    params = SamplingParams(max_tokens=20, temperature=1.0, repetition_penalty=1.7, presence_penalty=1.5,
                            frequency_penalty=0.9)
    (host,) = engine.add_request("Once upon a time", params, "host")
    (ahead,) = engine.add_request("Once upon a time", params, "ahead")
    fresh = next(t for t in range(300, 512) if t not in host.token_ids)  # in neither prompt nor outputs
    host.token_ids += [301, 302, 301, fresh]
    ahead.token_ids += [301, 302, 301, PENDING]
    logits = torch.randn(1, 512, generator=torch.Generator().manual_seed(0)) * 3
    want, got = logits.clone(), logits.clone()
    penalize(want, [0], [penalties_of(host)])
    penalize(got, [0], [penalties_of(ahead)], [torch.tensor([fresh])])
    assert torch.equal(got, want)
    assert want[0, fresh] != logits[0, fresh]  # the in-flight token was penalised


def _reference_penalties(row: torch.Tensor, q: Penalties) -> torch.Tensor:
    """The penalties as their definitions state them (transformers' and OpenAI's), one row at a time."""
    row = row.clone()
    seen = sorted({t for t in q.prompt.tolist() + list(q.output) if 0 <= t < row.shape[0]})
    if q.repetition != 1.0:
        v = row[seen]
        row[seen] = torch.where(v > 0, v / q.repetition, v * q.repetition)
    for t in set(q.output):
        n = list(q.output).count(t)
        row[t] -= q.frequency * n + q.presence
    return row


def test_penalties_of_a_batch_are_each_row_alone_and_their_definition():
    """Penalised rows among plain ones, in any order, each with its own penalties and history (prompt
    tokens only, repeats, no output yet): every row is exactly what penalising it alone gives (so a
    seeded row does not depend on its batch), and what the definitions give; plain rows are untouched."""
    rng = random.Random(0)
    vocab = 400
    for trial in range(10):
        n = 9
        logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(trial)) * 3
        rows = sorted(rng.sample(range(n), 6), key=lambda _: rng.random())
        qs = []
        for _ in rows:
            prompt_len = rng.randint(1, 20)
            prompt = np.array([rng.randrange(0, 60) for _ in range(prompt_len)], dtype=np.int32)
            output = [rng.randrange(0, 60) for _ in range(rng.choice((0, 1, 15)))]
            qs.append(Penalties(rng.choice((1.0, 1.3, 2.0)), rng.choice((0.0, 0.5, 1.7)), rng.choice((0.0, 0.9)),
                                prompt, output))
        got = logits.clone()
        penalize(got, rows, qs)
        strided = logits.t().contiguous().t()  # the same values, column-major: not viewable flat
        penalize(strided, rows, qs)
        assert not strided.is_contiguous() and torch.equal(strided, got)
        for r in range(n):
            if r not in rows:
                assert torch.equal(got[r], logits[r])
        for r, q in zip(rows, qs):
            alone = logits[r:r + 1].clone()
            penalize(alone, [0], [q])
            assert torch.equal(got[r], alone[0]), (trial, r)
            torch.testing.assert_close(got[r], _reference_penalties(logits[r], q), rtol=1e-6, atol=1e-6)
