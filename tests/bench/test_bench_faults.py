"""A server that errs, rate-limits or drops streams: the run completes and reports each class;
a dead server fails fast; the soak gate trips on a leaking server and passes on a steady one."""

from __future__ import annotations

import pytest
from bench_helpers import FakeServer, FakeState, bench, free_port, read_json, write_jsonl


@pytest.fixture
def fake():
    servers = []

    def start(**state) -> FakeServer:
        servers.append(FakeServer(FakeState(**state)))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def test_each_failure_class_is_reported(fake, tmp_path):
    server = fake(retry_after="0.2")
    prompts = [
        "ok",
        "error500",
        "ratelimit-once-1",
        "ratelimit-always",
        "drop",
        "incomplete",
        "stream-error",
        "ok",
    ]
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p, "output_len": 5} for p in prompts])
    out = tmp_path / "r.json"
    rc = bench(
        "serve",
        "--base-url",
        server.url,
        "--dataset",
        "jsonl",
        "--dataset-path",
        path,
        "--num-prompts",
        str(len(prompts)),
        "--max-concurrency",
        "1",
        "--max-retries-429",
        "2",
        "--no-progress",
        "--result-file",
        str(out),
    )
    assert rc == 0  # some requests succeeded: the run completed
    (run,) = read_json(out)["runs"]
    s = run["summary"]
    assert s["completed"] == 3  # ok, ok, and ratelimit-once after one retry
    assert s["errors"] == {"http_500": 1, "http_429": 1, "disconnect": 1, "incomplete": 1, "stream_error": 1}
    assert s["status_counts"] == {"200": 6, "429": 1, "500": 1}
    rl = s["rate_limits"]
    # ratelimit-once: one 429, then a retry after 0.2 s succeeds;
    # ratelimit-always: 3 answers, 2 retries, then given up
    assert rl == {
        "responses_429": 4,
        "with_retry_after": 4,
        "retries_after_wait": 3,
        "retries_that_succeeded": 1,
        "advice_too_short": 2,
        "requests_given_up": 1,
    }
    once = next(r for r in run["requests"] if r["rate_limited"] == 1)
    assert once["error"] is None and once["attempts"] == 2 and once["retry_after"] == [0.2]
    assert once["e2e"] >= 0.2  # its latency includes the advised wait
    assert server.state.attempts["ratelimit-always"] == 3
    assert server.state.attempts["ratelimit-once-1"] == 2
    drop = next(r for r in run["requests"] if r["error"] == "disconnect")
    assert drop["ttft"] is not None  # it had streamed tokens before the connection broke


def test_retry_after_not_honoured_when_retries_are_off(fake, tmp_path):
    server = fake()
    path = write_jsonl(tmp_path / "p.jsonl", ["ratelimit-once-2"])
    out = tmp_path / "r.json"
    assert (
        bench(
            "serve",
            "--base-url",
            server.url,
            "--dataset",
            "jsonl",
            "--dataset-path",
            path,
            "--num-prompts",
            "1",
            "--max-retries-429",
            "0",
            "--no-progress",
            "--result-file",
            str(out),
        )
        == 1
    )  # nothing completed
    rl = read_json(out)["runs"][0]["summary"]["rate_limits"]
    assert rl["responses_429"] == 1 and rl["retries_after_wait"] == 0 and rl["requests_given_up"] == 1


def test_dead_server_fails_fast_with_a_clear_message(capsys):
    port = free_port()  # nothing listens there
    rc = bench("serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "3", "--no-progress")
    assert rc == 2
    err = capsys.readouterr().err
    assert f"cannot connect to http://127.0.0.1:{port}" in err and "is the server running" in err


def test_unbounded_duration_is_refused(fake, capsys):
    server = fake()
    assert bench("serve", "--base-url", server.url, "--duration", "1s", "--no-progress") == 2
    assert "give a finite --request-rate or a --max-concurrency" in capsys.readouterr().err
    assert server.state.served == 0


def test_live_progress_bar_on_a_terminal(fake, monkeypatch, capsys):
    monkeypatch.setenv("FORCE_COLOR", "1")  # rich then draws as on a terminal
    monkeypatch.setenv("TTY_COMPATIBLE", "1")
    server = fake()
    assert bench("serve", "--base-url", server.url, "--num-prompts", "3", "--random-output-len", "2") == 0
    out = capsys.readouterr().out
    assert "3/3" in out and "0 errors" in out


def test_server_without_metrics_is_measured_all_the_same(fake, tmp_path):
    server = fake(expose_metrics=False)
    out = tmp_path / "r.json"
    assert (
        bench(
            "serve",
            "--base-url",
            server.url,
            "--num-prompts",
            "3",
            "--random-output-len",
            "4",
            "--no-progress",
            "--result-file",
            str(out),
        )
        == 0
    )
    (run,) = read_json(out)["runs"]
    assert run["summary"]["completed"] == 3 and run["summary"]["total_output_tokens"] == 12
    assert run["server"] == {
        "metrics_exposed": False,
        "peak_rss_bytes": None,
        "peak_kv_usage": None,
        "counter_deltas": {},
    }


def soak(server, tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "soak.json"
    rc = bench(
        "serve",
        "--base-url",
        server.url,
        "--soak",
        "2s",
        "--report-interval",
        "0.5s",
        "--request-rate",
        "40",
        "--random-output-len",
        "3",
        "--no-progress",
        "--result-file",
        str(out),
        *extra,
    )
    return rc, read_json(out)


def test_soak_gate_trips_on_a_leaking_server(fake, tmp_path, capsys):
    server = fake(leak_bytes=4 * 2**20)  # 4 MiB more RSS per request served
    rc, doc = soak(server, tmp_path, "--max-rss-growth", "20%")
    assert rc == 1
    windows = doc["soak"]["windows"]
    assert len(windows) >= 2 and windows[-1]["rss_bytes"] > windows[0]["rss_bytes"]
    verdict = doc["soak"]["verdict"]
    assert verdict["passed"] is False and verdict["rss_growth"] > 0.2
    assert "server RSS grew" in verdict["failures"][0]
    assert "FAIL" in capsys.readouterr().out


def test_soak_gate_passes_on_a_steady_server(fake, tmp_path):
    server = fake(leak_bytes=0)
    rc, doc = soak(server, tmp_path, "--max-rss-growth", "20%", "--plot", str(tmp_path / "soak.png"))
    assert rc == 0
    assert (tmp_path / "soak.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert doc["runs"][0]["server"]["peak_rss_bytes"] == server.state.base_rss
    verdict = doc["soak"]["verdict"]
    assert verdict["passed"] is True and verdict["rss_growth"] == 0.0 and verdict["error_rate"] == 0.0
    assert sum(w["requests"] for w in doc["soak"]["windows"]) == doc["runs"][0]["summary"]["requests"]


def test_soak_gate_trips_on_errors(fake, tmp_path):
    server = fake()
    path = write_jsonl(tmp_path / "p.jsonl", ["ok", "error500"])
    rc, doc = soak(server, tmp_path, "--dataset", "jsonl", "--dataset-path", path, "--max-error-rate", "10%")
    assert rc == 1
    verdict = doc["soak"]["verdict"]
    assert verdict["error_rate"] == pytest.approx(0.5, abs=0.1)
    assert "error rate" in verdict["failures"][0]
