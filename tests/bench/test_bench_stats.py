"""The statistics against hand-computed values on a recorded trace; arrivals, parsers, datasets."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
from bench_helpers import bench, read_json

from kvrelay.bench import datasets
from kvrelay.bench.client import RequestResult, parse_retry_after
from kvrelay.bench.load import LoadShape, arrival_gaps, parse_tenant
from kvrelay.bench.serve import parse_duration
from kvrelay.bench.soak import Window, judge
from kvrelay.bench.stats import distribution, parse_slo, summarize


def rec(i, ttft, e2e, out, itl, error=None, status=200, **kw) -> RequestResult:
    r = RequestResult(
        index=i,
        session=i,
        turn=0,
        tenant=kw.pop("tenant", None),
        start=0.0,
        status=status,
        error=error,
        ttft=ttft,
        e2e=e2e,
        itl=itl,
        prompt_tokens=10 if not error else None,
        output_tokens=out,
        usage_reported=not error,
        **kw,
    )
    return r


TRACE = [
    rec(0, 0.1, 0.5, 5, [0.1] * 4, tenant="a"),  # TPOT 0.4 / 4 = 0.1
    rec(1, 0.2, 1.0, 9, [0.1] * 8, tenant="a"),  # TPOT 0.8 / 8 = 0.1
    rec(2, 0.3, 0.7, 3, [0.2] * 2, tenant="b"),  # TPOT 0.4 / 2 = 0.2
    rec(3, 0.4, 0.4, 1, [], tenant="b"),  # one token: no TPOT
    rec(4, None, None, None, [], error="http_500", status=500, tenant="b"),
]


def test_summary_of_a_recorded_trace():
    s = summarize(TRACE, 2.0, parse_slo("ttft=0.25,tpot=0.15"), cost_per_hour=3.6)
    assert (s["requests"], s["completed"], s["failed"]) == (5, 4, 1)
    assert s["total_output_tokens"] == 18 and s["total_input_tokens"] == 40
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["output_throughput"] == pytest.approx(9.0)
    assert s["total_token_throughput"] == pytest.approx(29.0)
    # TTFT 0.1 0.2 0.3 0.4, linear interpolation: p90 at rank 2.7 -> 0.3 + 0.7 * 0.1
    assert s["ttft_s"] == pytest.approx(
        {"mean": 0.25, "p50": 0.25, "p90": 0.37, "p95": 0.385, "p99": 0.397, "max": 0.4}
    )
    # E2E 0.4 0.5 0.7 1.0: p50 at rank 1.5 -> 0.6; p99 at rank 2.97 -> 0.7 + 0.97 * 0.3
    assert s["e2e_s"]["mean"] == pytest.approx(0.65)
    assert s["e2e_s"]["p50"] == pytest.approx(0.6)
    assert s["e2e_s"]["p99"] == pytest.approx(0.991)
    # TPOT 0.1 0.1 0.2: p90 at rank 1.8 -> 0.1 + 0.8 * 0.1
    assert s["tpot_s"]["mean"] == pytest.approx(0.4 / 3)
    assert s["tpot_s"]["p90"] == pytest.approx(0.18)
    # ITL: twelve 0.1 and two 0.2; p90 at rank 11.7 -> 0.1 + 0.7 * 0.1
    assert s["itl_s"]["mean"] == pytest.approx(1.6 / 14)
    assert s["itl_s"]["p50"] == pytest.approx(0.1)
    assert s["itl_s"]["p90"] == pytest.approx(0.17)
    assert s["itl_s"]["max"] == pytest.approx(0.2)
    # goodput: requests 0 and 1 meet TTFT <= 0.25 and TPOT <= 0.15
    assert s["good_requests"] == 2 and s["goodput"] == pytest.approx(1.0)
    # 3.6/hour for 2 s = 0.002, over 18 tokens
    assert s["cost_per_million_output_tokens"] == pytest.approx(0.002 / 18 * 1e6)
    assert s["errors"] == {"http_500": 1} and s["status_counts"] == {"200": 4, "500": 1}
    assert s["tenants"]["a"]["completed"] == 2 and s["tenants"]["b"]["errors"] == {"http_500": 1}
    assert s["tenants"]["a"]["output_throughput"] == pytest.approx(7.0)


def test_goodput_on_end_to_end_latency_and_empty_distributions():
    s = summarize(TRACE, 2.0, {"e2e": 0.6})
    assert s["good_requests"] == 2  # E2E 0.5 and 0.4
    assert distribution([]) == dict.fromkeys(["mean", "p50", "p90", "p95", "p99", "max"])
    assert summarize([], 1.0)["ttft_s"]["p99"] is None


def test_rate_limit_accounting():
    retried = rec(
        0, 0.1, 2.0, 3, [0.1, 0.1], rate_limited=2, retry_after=[1.0, None], retries_after_wait=2, attempts=3
    )
    gave_up = rec(
        1, None, None, None, [], error="http_429", status=429, rate_limited=1, retry_after=[3.0], attempts=1
    )
    rl = summarize([retried, gave_up], 1.0)["rate_limits"]
    assert rl == {
        "responses_429": 3,
        "with_retry_after": 2,
        "retries_after_wait": 2,
        "retries_that_succeeded": 1,
        "advice_too_short": 1,
        "requests_given_up": 1,
    }


@pytest.mark.parametrize("burstiness, cv", [(1.0, 1.0), (0.25, 2.0), (4.0, 0.5)])
def test_arrival_gaps_have_the_rate_and_burstiness(burstiness, cv):
    gen = arrival_gaps(LoadShape(request_rate=10.0, burstiness=burstiness), np.random.default_rng(0))
    gaps = np.array([next(gen) for _ in range(20000)])
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)  # gamma: CV = 1 / sqrt(shape)
    inf = arrival_gaps(LoadShape(), np.random.default_rng(0))
    assert [next(inf) for _ in range(3)] == [0.0, 0.0, 0.0]


def test_parsers_name_the_flag():
    assert parse_slo("ttft=0.5,tpot=0.05") == {"ttft": 0.5, "tpot": 0.05}
    with pytest.raises(ValueError, match="--slo"):
        parse_slo("latency=1")
    assert parse_duration("30m") == 1800 and parse_duration("2h") == 7200 and parse_duration("45") == 45
    with pytest.raises(argparse.ArgumentTypeError, match="30m"):
        parse_duration("thirty")
    t = parse_tenant("alice:sk-1:2.5")
    assert (t.name, t.api_key, t.weight) == ("alice", "sk-1", 2.5)
    with pytest.raises(ValueError, match="--tenant"):
        parse_tenant("alice")
    assert parse_retry_after("3") == 3.0 and parse_retry_after(None) is None
    assert 0 <= parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") <= 1  # a past date: retry now


def test_soak_verdict():
    w = [Window(1, 10, 0, 0.0, 0.1, None, 100.0), Window(2, 10, 1, 0.1, 0.1, 0.0, 130.0)]
    assert judge(w, 20, 1, 0.1, 0.5).passed
    v = judge(w, 20, 1, 0.01, 0.2)
    assert v.rss_growth == pytest.approx(0.3) and len(v.failures) == 2
    no_rss = [Window(1, 10, 0, 0.0, 0.1, None, None)]
    assert "--server-pid" in judge(no_rss, 10, 0, 0.1, 0.2).failures[0]


def test_datasets_are_seeded_and_shaped(tmp_path):
    cfg = datasets.DatasetConfig(
        name="random", num_prompts=6, random_input_len=10, random_output_len=4, random_range_ratio=0.5, seed=3
    )
    a, b = datasets.load_dataset(cfg), datasets.load_dataset(cfg)
    assert [s.turns[0].text for s in a] == [s.turns[0].text for s in b]
    assert all(5 <= len(s.turns[0].text.split()) <= 15 and 2 <= s.turns[0].output_len <= 6 for s in a)
    cfg.seed = 4
    assert [s.turns[0].text for s in datasets.load_dataset(cfg)] != [s.turns[0].text for s in a]
    prefix = datasets.load_dataset(
        datasets.DatasetConfig(name="prefix", num_prompts=9, num_prefixes=3, prefix_len=5, suffix_len=2)
    )
    systems = [s.system for s in prefix]
    assert len(set(systems)) == 3 and all(systems.count(x) == 3 for x in set(systems))
    convo = datasets.load_dataset(datasets.DatasetConfig(name="conversation", num_prompts=2, num_turns=4))
    assert [len(s.turns) for s in convo] == [4, 4]


def test_dataset_files_are_checked(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"conversations": [{"from": "gpt", "value": "no question"}]}]))
    with pytest.raises(ValueError, match="--dataset-path: .* no ShareGPT conversation"):
        datasets.load_dataset(datasets.DatasetConfig(name="sharegpt", path=str(bad), num_prompts=1))
    with pytest.raises(ValueError, match="reads a local file"):
        datasets.load_dataset(datasets.DatasetConfig(name="jsonl", num_prompts=1))
    lines = tmp_path / "p.jsonl"
    lines.write_text('{"prompt": "hi"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match='record 2: needs a non-empty string "prompt"'):
        datasets.load_dataset(datasets.DatasetConfig(name="jsonl", path=str(lines), num_prompts=1))


def test_offline_throughput(tmp_path, capsys):
    out = tmp_path / "t.json"
    assert (
        bench(
            "throughput",
            "--num-prompts",
            "4",
            "--random-input-len",
            "8",
            "--random-output-len",
            "5",
            "--result-file",
            str(out),
        )
        == 0
    )
    r = read_json(out)["result"]
    assert r["requests"] == r["finished"] == 4 and r["output_tokens"] == 20
    assert r["output_throughput"] == pytest.approx(20 / r["elapsed_s"])
    assert "Throughput:" in capsys.readouterr().out


def test_render_chat_and_plain_prompts():
    from kvrelay.bench.datasets import Session, Turn
    from kvrelay.bench.load import render

    s = Session([Turn("hello", 2), Turn("more", 2)], system="be brief")
    history = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]
    assert render(s, 0, [], chat=False) == ("be brief\nhello", None)
    prompt, messages = render(s, 1, history, chat=True)
    assert prompt is None and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    prompt, _ = render(s, 1, history, chat=False)  # a conversation on /v1/completions: a transcript
    assert prompt == "system: be brief\nuser: hello\nassistant: hi\nuser: more\nassistant:"
