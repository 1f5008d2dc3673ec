"""`kvrelay bench serve` against a real `kvrelay serve` over real HTTP: every dataset and load shape,
with the client's counts cross-checked against the server's usage and its /metrics counters."""

from __future__ import annotations

import json

import pytest
from bench_helpers import ALICE_KEY, BOB_KEY, BOB_RPM, bench, max_overlap, metric_sum, read_json, write_jsonl

from kvrelay.models import BUNDLED_MODEL

TOKENIZER = str(BUNDLED_MODEL)


def run_bench(server, tmp, *extra: str, name: str = "r.json") -> dict:
    out = tmp / name
    rc = bench(
        "serve",
        "--base-url",
        server.url,
        "--api-key",
        ALICE_KEY,
        "--ignore-eos",
        "--no-progress",
        "--result-file",
        str(out),
        *extra,
    )
    assert rc == 0
    return read_json(out)


def check_counts(doc: dict, expected_requests: int, expected_max_tokens: list[int] | None) -> list[dict]:
    """Every request succeeded with usage; client totals equal the server's counters."""
    (run,) = doc["runs"]
    reqs, s, server = run["requests"], run["summary"], run["server"]
    assert len(reqs) == expected_requests == s["completed"] == s["usage_reported"]
    assert s["failed"] == 0 and s["status_counts"] == {"200": expected_requests}
    if expected_max_tokens is not None:
        assert sorted(r["output_tokens"] for r in reqs) == sorted(expected_max_tokens)
    assert server["metrics_exposed"] is True
    deltas = server["counter_deltas"]
    assert deltas["requests_finished"] == expected_requests
    assert deltas["generation_tokens"] == s["total_output_tokens"] == sum(r["output_tokens"] for r in reqs)
    assert deltas["prompt_tokens"] == s["total_input_tokens"] == sum(r["prompt_tokens"] for r in reqs)
    for r in reqs:
        assert r["ttft"] is not None and r["ttft"] <= r["e2e"]
        assert len(r["itl"]) >= 1  # several increments arrived
    return reqs


def test_random_dataset_counts_and_tokenizer(kvrelay_server, tmp_path):
    doc = run_bench(
        kvrelay_server,
        tmp_path,
        "--dataset",
        "random",
        "--num-prompts",
        "5",
        "--random-input-len",
        "12",
        "--random-output-len",
        "4",
        "--tokenizer",
        TOKENIZER,
    )
    reqs = check_counts(doc, 5, [4] * 5)
    for r in reqs:  # the client's tokenizer count is the server's
        assert r["prompt_tokens_client"] == r["prompt_tokens"]
        assert 2 <= r["prompt_tokens"] <= 13  # at most the asked length, plus BOS


def test_random_dataset_lengths_vary_within_the_range_ratio(kvrelay_server, tmp_path):
    doc = run_bench(
        kvrelay_server,
        tmp_path,
        "--num-prompts",
        "8",
        "--random-input-len",
        "8",
        "--random-output-len",
        "6",
        "--random-range-ratio",
        "0.5",
    )
    reqs = check_counts(doc, 8, None)
    assert all(3 <= r["output_tokens"] <= 9 for r in reqs)
    assert len({r["output_tokens"] for r in reqs}) > 1


def test_sharegpt_dataset(kvrelay_server, tmp_path):
    data = [
        {
            "conversations": [
                {"from": "human", "value": f"Tell me a story about cat number {i}."},
                {"from": "gpt", "value": "Once upon a time there was a cat."},
            ]
        }
        for i in range(3)
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    doc = run_bench(
        kvrelay_server,
        tmp_path,
        "--dataset",
        "sharegpt",
        "--dataset-path",
        str(path),
        "--num-prompts",
        "4",
        "--sharegpt-output-len",
        "3",
        "--tokenizer",
        TOKENIZER,
    )
    reqs = check_counts(doc, 4, [3] * 4)
    assert all(r["prompt_tokens_client"] == r["prompt_tokens"] for r in reqs)


def test_sharegpt_reply_lengths_come_from_the_recorded_replies(kvrelay_server, tmp_path):
    from kvrelay.engine.tokenizer import Tokenizer

    reply = "Once upon a time there was a big red ball."
    path = tmp_path / "sharegpt.json"
    path.write_text(
        json.dumps(
            [
                {
                    "conversations": [
                        {"from": "human", "value": "Tell me a story."},
                        {"from": "gpt", "value": reply},
                    ]
                }
            ]
        )
    )
    expected = len(Tokenizer(BUNDLED_MODEL).encode(reply, add_special_tokens=False))
    doc = run_bench(
        kvrelay_server,
        tmp_path,
        "--dataset",
        "sharegpt",
        "--dataset-path",
        str(path),
        "--num-prompts",
        "2",
        "--tokenizer",
        TOKENIZER,
    )
    check_counts(doc, 2, [expected] * 2)


def test_prefix_dataset_shares_system_prompts(kvrelay_server, tmp_path):
    doc = run_bench(
        kvrelay_server,
        tmp_path,
        "--dataset",
        "prefix",
        "--num-prompts",
        "6",
        "--prefix-repetition-num-prefixes",
        "2",
        "--prefix-repetition-prefix-len",
        "40",
        "--prefix-repetition-suffix-len",
        "6",
        "--prefix-repetition-output-len",
        "3",
        "--tokenizer",
        TOKENIZER,
    )
    reqs = check_counts(doc, 6, [3] * 6)
    assert all(r["prompt_tokens"] > 40 for r in reqs)  # every prompt holds a 40-token prefix


def test_conversation_dataset_resends_the_history(kvrelay_server, tmp_path):
    doc = run_bench(
        kvrelay_server,
        tmp_path,
        "--dataset",
        "conversation",
        "--num-prompts",
        "2",
        "--num-turns",
        "3",
        "--turn-len",
        "6",
        "--turn-output-len",
        "3",
        "--tokenizer",
        TOKENIZER,
    )
    assert doc["config"]["endpoint"] == "/v1/chat/completions"  # the conversation dataset's default
    reqs = check_counts(doc, 6, [3] * 6)
    for session in (0, 1):
        turns = sorted((r for r in reqs if r["session"] == session), key=lambda r: r["turn"])
        assert [r["turn"] for r in turns] == [0, 1, 2]
        lens = [r["prompt_tokens"] for r in turns]
        assert lens[0] < lens[1] < lens[2]  # each turn resends the earlier turns and replies
        assert all(r["prompt_tokens_client"] == r["prompt_tokens"] for r in turns)  # same chat template


def test_jsonl_dataset_with_output_lengths(kvrelay_server, tmp_path):
    path = write_jsonl(
        tmp_path / "prompts.jsonl",
        [
            {"prompt": "The dog ran", "output_len": 2},
            {"prompt": "A girl named Lily", "output_len": 5},
            "Once upon",
        ],
    )
    doc = run_bench(
        kvrelay_server,
        tmp_path,
        "--dataset",
        "jsonl",
        "--dataset-path",
        path,
        "--num-prompts",
        "3",
        "--jsonl-output-len",
        "4",
    )
    check_counts(doc, 3, [2, 5, 4])


def test_concurrency_sweep_caps_requests_in_flight(kvrelay_server, tmp_path):
    doc = run_bench(
        kvrelay_server,
        tmp_path,
        "--num-prompts",
        "6",
        "--random-input-len",
        "8",
        "--random-output-len",
        "8",
        "--max-concurrency",
        "1,3",
        "--plot",
        str(tmp_path / "p.png"),
    )
    assert [r["load"]["max_concurrency"] for r in doc["runs"]] == [1, 3]
    one, three = doc["runs"]
    assert len(one["requests"]) == len(three["requests"]) == 6
    assert max_overlap(one["requests"]) == 1
    assert max_overlap(three["requests"]) <= 3
    assert one["server"]["counter_deltas"]["requests_finished"] == 6


def test_rate_sweep_with_bursty_arrivals(kvrelay_server, tmp_path):
    doc = run_bench(
        kvrelay_server,
        tmp_path,
        "--num-prompts",
        "5",
        "--random-input-len",
        "8",
        "--random-output-len",
        "2",
        "--request-rate",
        "40,inf",
        "--burstiness",
        "0.5",
        "--slo",
        "ttft=60,tpot=60",
    )
    assert [r["load"]["request_rate"] for r in doc["runs"]] == [40.0, None]
    for run in doc["runs"]:
        s = run["summary"]
        assert s["completed"] == 5 and s["good_requests"] == 5  # generous SLOs: every request meets them
        assert s["goodput"] == pytest.approx(s["request_throughput"])
    starts = sorted(r["start"] for r in doc["runs"][0]["requests"])
    assert starts[-1] > starts[0]  # paced arrivals, not one burst


def test_duration_and_warmup(kvrelay_server, tmp_path):
    before = metric_sum(kvrelay_server.url, "kvrelay:request_success_total")
    doc = run_bench(
        kvrelay_server,
        tmp_path,
        "--duration",
        "1s",
        "--request-rate",
        "8",
        "--random-input-len",
        "8",
        "--random-output-len",
        "2",
        "--warmup",
        "2",
    )
    (run,) = doc["runs"]
    n = len(run["requests"])
    assert n >= 1 and run["summary"]["completed"] == n
    after = metric_sum(kvrelay_server.url, "kvrelay:request_success_total")
    assert after - before == n + 2  # the warm-up reached the server but not the results
    assert run["server"]["counter_deltas"]["requests_finished"] == n


def test_duration_with_a_concurrency_limit_keeps_no_backlog(kvrelay_server, tmp_path):
    doc = run_bench(
        kvrelay_server,
        tmp_path,
        "--duration",
        "1s",
        "--max-concurrency",
        "2",
        "--random-input-len",
        "8",
        "--random-output-len",
        "2",
    )
    reqs = doc["runs"][0]["requests"]
    assert max_overlap(reqs) <= 2
    # Sessions wait for a slot before they are created: none queue up to run after the deadline.
    assert sum(1 for r in reqs if r["start"] > 1.0) <= 2
    assert doc["runs"][0]["server"]["counter_deltas"]["requests_finished"] == len(reqs)


def test_tenant_mix_reports_quota_429s_per_tenant(kvrelay_server, tmp_path):
    rejections = metric_sum(kvrelay_server.url, "kvrelay:quota_rejections_total")
    doc = run_bench(
        kvrelay_server,
        tmp_path,
        "--num-prompts",
        "12",
        "--random-input-len",
        "6",
        "--random-output-len",
        "2",
        "--max-concurrency",
        "2",
        "--tenant",
        f"alice:{ALICE_KEY}:1",
        "--tenant",
        f"bob:{BOB_KEY}:3",
        "--max-retries-429",
        "0",
    )
    assert ALICE_KEY not in json.dumps(doc) and BOB_KEY not in json.dumps(doc)  # keys never reach the file
    (run,) = doc["runs"]
    s = run["summary"]
    by_tenant = {t: [r for r in run["requests"] if r["tenant"] == t] for t in ("alice", "bob")}
    assert len(by_tenant["bob"]) > BOB_RPM
    bob, alice = s["tenants"]["bob"], s["tenants"]["alice"]
    assert bob["completed"] == BOB_RPM
    assert bob["responses_429"] == len(by_tenant["bob"]) - BOB_RPM == s["errors"]["http_429"]
    assert alice["completed"] == alice["requests"] == len(by_tenant["alice"])
    rl = s["rate_limits"]
    assert rl["responses_429"] == rl["with_retry_after"] == rl["requests_given_up"] == bob["responses_429"]
    assert (
        metric_sum(kvrelay_server.url, "kvrelay:quota_rejections_total") - rejections == rl["responses_429"]
    )


def test_plot_and_compare(kvrelay_server, tmp_path, capsys):
    from PIL import Image

    from kvrelay.bench.compare import ratios
    from kvrelay.bench.plot import PANELS

    png = tmp_path / "plot.png"
    a = run_bench(
        kvrelay_server,
        tmp_path,
        "--num-prompts",
        "4",
        "--random-input-len",
        "8",
        "--random-output-len",
        "3",
        "--max-concurrency",
        "1,2",
        "--plot",
        str(png),
        name="a.json",
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(png) as img:
        img.verify()
    with Image.open(png) as img:
        assert img.size[0] > 500 and img.size[1] > 400
        assert img.info["Panels"].split("; ") == list(PANELS)
    b = run_bench(
        kvrelay_server,
        tmp_path,
        "--num-prompts",
        "4",
        "--random-input-len",
        "8",
        "--random-output-len",
        "6",
        "--max-concurrency",
        "1,2",
        name="b.json",
    )
    capsys.readouterr()
    assert bench("compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")) == 0
    out = capsys.readouterr().out
    assert "output throughput" in out and "B/A" in out and "TTFT p99" in out
    r = ratios(a["runs"][0], b["runs"][0])
    assert r["completed"] == 1.0
    assert r["TTFT p99 (ms)"] == pytest.approx(
        b["runs"][0]["summary"]["ttft_s"]["p99"] / a["runs"][0]["summary"]["ttft_s"]["p99"]
    )


def test_embeddings_endpoint_against_an_embedding_server(own_tmp, tmp_path):
    """--endpoint /v1/embeddings: each request's latency stands for its TTFT, no output tokens, and
    the prompt tokens equal the client's tokenizer count and the server's counter."""
    from gateway_helpers import GatewayProcess

    server = GatewayProcess(["--runner", "pooling"], own_tmp / "embed.log")
    try:
        out = tmp_path / "e.json"
        rc = bench("serve", "--base-url", server.url, "--endpoint", "/v1/embeddings", "--no-progress",
                   "--result-file", str(out), "--dataset", "random", "--num-prompts", "6", "--random-input-len", "12",
                   "--tokenizer", TOKENIZER)
        assert rc == 0
        (run,) = read_json(out)["runs"]
        reqs, s = run["requests"], run["summary"]
        assert s["completed"] == 6 and s["failed"] == 0 and s["total_output_tokens"] == 0
        for r in reqs:
            assert r["prompt_tokens"] == r["prompt_tokens_client"] and r["ttft"] == r["e2e"] > 0
        assert run["server"]["counter_deltas"]["prompt_tokens"] == s["total_input_tokens"]
        assert run["server"]["counter_deltas"]["requests_finished"] == 6
    finally:
        server.stop()


def test_random_images_against_a_vision_language_server(own_tmp, tmp_path):
    """--random-images: each chat request carries its own pictures; the server counts each image's
    16 placeholder tokens in the prompt."""
    import sys
    from pathlib import Path

    from gateway_helpers import GatewayProcess

    sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
    from vision_models import TOKENS_PER_IMAGE, save_tiny_llava

    model = save_tiny_llava(tmp_path / "tiny-llava")
    server = GatewayProcess(["--model", str(model)], own_tmp / "vision.log")
    try:
        out = tmp_path / "v.json"
        rc = bench("serve", "--base-url", server.url, "--endpoint", "/v1/chat/completions", "--no-progress",
                   "--result-file", str(out), "--num-prompts", "4", "--random-input-len", "8",
                   "--random-output-len", "4", "--ignore-eos", "--random-images", "2", "--random-image-size", "40x48")
        assert rc == 0
        (run,) = read_json(out)["runs"]
        s = run["summary"]
        assert s["completed"] == 4 and s["failed"] == 0 and s["total_output_tokens"] == 16
        assert all(r["prompt_tokens"] > 2 * TOKENS_PER_IMAGE for r in run["requests"])
        assert run["server"]["counter_deltas"]["prompt_tokens"] == s["total_input_tokens"]
        with pytest.raises(SystemExit, match="--random-images needs --endpoint /v1/chat/completions"):
            bench("serve", "--base-url", server.url, "--random-images", "1", "--no-progress")
    finally:
        server.stop()
