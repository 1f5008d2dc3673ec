"""Operator-facing logs: one access line per request, a periodic engine stats line, `--log-format json`, and
a client's X-Request-Id honoured, returned and carried to the workers' logs. No prompt or key is ever logged."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from gateway_helpers import GatewayProcess, write_tenants
from kvrelay.gateway.tenants import hash_key

SECRET_PROMPT = "Zebra quartz banana umbrella"  # a prompt that must never reach a log
KEY = "sk-test-never-logged-7f3a"


def _wait_for(path, needle: str, timeout: float = 20) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text()
        if needle in text:
            return text
        time.sleep(0.1)
    raise AssertionError(f"{needle!r} not logged:\n{path.read_text()[-3000:]}")


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_access_and_stats_lines_with_request_id_and_no_prompt_or_key(fmt, own_tmp):
    tenants = write_tenants(own_tmp / f"tenants-{fmt}.yaml", [{"id": "acme", "api_keys_sha256": [hash_key(KEY)]}])
    log_path = own_tmp / f"serve-{fmt}.log"
    serve = GatewayProcess(["--tenants", tenants, "--log-level", "info", "--log-format", fmt, "--stats-interval",
                            "0.5"], log_path)
    try:
        headers = {"Authorization": f"Bearer {KEY}", "X-Request-Id": f"trace-{fmt}-1"}
        r = httpx.post(serve.url + "/v1/completions", headers=headers, timeout=30,
                       json={"model": "stories260K", "prompt": SECRET_PROMPT, "max_tokens": 7})
        assert r.status_code == 200 and r.headers["x-request-id"] == f"trace-{fmt}-1"
        bad = httpx.post(serve.url + "/v1/completions", headers={"Authorization": "Bearer wrong"}, timeout=30,
                         json={"model": "stories260K", "prompt": SECRET_PROMPT, "max_tokens": 7})
        assert bad.status_code == 401 and len(bad.headers["x-request-id"]) == 32  # one made for it
        text = _wait_for(log_path, "generation throughput")
    finally:
        serve.stop()
    text = log_path.read_text()
    assert SECRET_PROMPT not in text and "Zebra" not in text and KEY not in text
    if fmt == "json":
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
        access = [r for r in records if r["logger"] == "kvrelay.access"]
        ok = next(r for r in access if r["request_id"] == "trace-json-1")
        assert ok["status"] == 200 and ok["tenant"] == "acme" and ok["model"] == "stories260K"
        assert ok["completion_tokens"] == 7 and ok["prompt_tokens"] > 0
        assert 0 <= ok["queue_s"] <= ok["ttft_s"] <= ok["duration_s"]
        denied = next(r for r in access if r["status"] == 401)
        assert denied["tenant"] == "-" and denied["completion_tokens"] == 0
        stats = next(r for r in records if r["logger"] == "kvrelay.stats")
        assert stats["generation_throughput"] > 0 and {"running", "waiting", "kv_cache_usage",
                                                       "prefix_cache_hit_rate", "preemptions"} <= set(stats)
    else:
        line = next(x for x in text.splitlines() if "request_id=trace-text-1" in x)
        assert "tenant=acme model=stories260K method=POST path=/v1/completions status=200" in line
        assert "completion_tokens=7" in line and "ttft_s=" in line and "duration_s=" in line
        assert sum("kvrelay.access" in x for x in text.splitlines()) == 2  # one line per request
        assert "serve engine: prompt throughput" in text and "prefix cache hit rate" in text


def test_request_id_reaches_the_workers_logs(own_tmp):
    log_path = own_tmp / "serve-disagg.log"
    serve = GatewayProcess(["--host", "127.0.0.1", "--disaggregated", "--log-level", "info"], log_path)
    try:
        r = httpx.post(serve.url + "/v1/completions", headers={"X-Request-Id": "trace-pd-9"}, timeout=30,
                       json={"model": "stories260K", "prompt": SECRET_PROMPT * 3, "max_tokens": 5})
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-pd-9"
        # Each process logs when it is done, in no fixed order after the response.
        for line in ("ended: length, 5 tokens", "hand-off of", "request_id=trace-pd-9"):
            text = _wait_for(log_path, line)
    finally:
        serve.stop()
    decode_line = next(x for x in text.splitlines() if "kvrelay.decode.worker" in x and "ended:" in x)
    prefill_line = next(x for x in text.splitlines() if "hand-off of" in x)
    assert "x-request-id trace-pd-9" in decode_line and "x-request-id trace-pd-9" in prefill_line
    assert SECRET_PROMPT not in text
