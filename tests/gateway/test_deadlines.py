"""Request deadlines: --request-timeout, capped per tenant; on expiry every hop aborts and the client gets a
504 in OpenAI's shape, or an SSE error event when streaming."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from gateway_helpers import InProcessGateway, WorkerProcess, write_tenants
from kvrelay.gateway.disaggregated import DisaggregatedBackend
from kvrelay.gateway.gateway import GatewayConfig
from kvrelay.gateway.tenants import TenantConfigError, hash_key, parse_tenants

from kvrelay.models import BUNDLED_MODEL

MODEL = "stories260K"
LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True}


def wait_until(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture(scope="module")
def capped_gateway(tmp_path_factory):
    tenants = write_tenants(tmp_path_factory.mktemp("t") / "tenants.yaml", [
        {"id": "hasty", "api_keys_sha256": [hash_key("k-hasty")], "request_timeout_s": 0.15},
        {"id": "patient", "api_keys_sha256": [hash_key("k-patient")]},
    ])
    # A step slowed down so that 480 tokens take far longer than the tenant's cap.
    gw = InProcessGateway(tenants_file=tenants, config=GatewayConfig(request_timeout_s=30.0),
                          engine_kwargs={"max_num_seqs": 4})
    engine = gw.engine.engine
    step = engine.step

    def slow_step():
        time.sleep(0.005)
        return step()

    engine.step = slow_step
    yield gw
    engine.step = step
    gw.stop()


def _engine_idle(gw) -> bool:
    s = gw.engine.stats()
    return s.num_running == 0 and s.num_waiting == 0 and s.kv_blocks_free == s.kv_blocks_total


def test_tenant_cap_gives_504_in_openai_shape_and_frees_the_blocks(capped_gateway):
    t0 = time.monotonic()
    r = httpx.post(capped_gateway.url + "/v1/completions", json=LONG, timeout=30,
                   headers={"Authorization": "Bearer k-hasty"})
    assert r.status_code == 504, r.text
    assert time.monotonic() - t0 < 5
    err = r.json()["error"]
    assert err["type"] == "timeout_error" and err["code"] == "request_timeout" and "0.15 s" in err["message"]
    assert wait_until(lambda: _engine_idle(capped_gateway))
    # The other tenant runs under the gateway's 30 s and completes.
    r = httpx.post(capped_gateway.url + "/v1/completions", json={**LONG, "max_tokens": 8}, timeout=30,
                   headers={"Authorization": "Bearer k-patient"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def test_deadline_mid_stream_is_an_sse_error_event(capped_gateway):
    with httpx.stream("POST", capped_gateway.url + "/v1/completions", json={**LONG, "stream": True}, timeout=30,
                      headers={"Authorization": "Bearer k-hasty"}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "request_timeout"
    assert any("choices" in json.loads(e) for e in events[:-2])  # tokens had been streamed before it
    assert wait_until(lambda: _engine_idle(capped_gateway))


def test_deadline_mid_stream_of_a_response_is_an_error_event_then_failed(capped_gateway):
    """The Responses API's stream (responses_writer.py) ends with `error` and `response.failed`."""
    body = {"model": MODEL, "input": "Tell me a story", "max_output_tokens": 480, "temperature": 0.0, "stream": True}
    with httpx.stream("POST", capped_gateway.url + "/v1/responses", json=body, timeout=30,
                      headers={"Authorization": "Bearer k-hasty"}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "request_timeout" and events[-1]["response"]["status"] == "failed"
    assert any(e["type"] == "response.output_text.delta" for e in events)  # text had been streamed before it
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert wait_until(lambda: _engine_idle(capped_gateway))


def test_tenant_request_timeout_is_validated():
    with pytest.raises(TenantConfigError, match="request_timeout_s"):
        parse_tenants({"tenants": [{"id": "a", "request_timeout_s": 0}]})
    assert parse_tenants({"tenants": [{"id": "a", "request_timeout_s": 2.5}]})[0].request_timeout_s == 2.5


def test_deadline_mid_hand_off_aborts_all_three_hops():
    # Chunks of 8 KiB each followed by a 0.3 s pause: the hand-off outlasts the 1 s deadline.
    prefill = WorkerProcess("prefill", "--max-message-bytes", "8KiB", "--debug-chunk-delay", "0.3",
                            "--stream-min-tokens", "100000")
    decode = WorkerProcess("decode", "--max-message-bytes", "8KiB")
    backend = DisaggregatedBackend(prefill.address, decode.address, str(BUNDLED_MODEL))
    gw = InProcessGateway(backend=backend, config=GatewayConfig(request_timeout_s=1.0))
    try:
        assert wait_until(lambda: backend.decode.live() and backend.prefill.live(), 30)
        prompt = "Once upon a time, there was a little girl named Lily. " * 6
        t0 = time.monotonic()
        r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4},
                       timeout=30)
        elapsed = time.monotonic() - t0
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout", r.text
        assert elapsed < 2.0
        # The decode worker's call was cancelled by its deadline, and it aborted the prefill call.
        assert wait_until(lambda: decode.metric('kvrelay:kv_transfer_aborts_total{reason="client"}') == 1)
        # The prefill worker's hand-off ended unacknowledged (the decode worker's abort, or its own
        # deadline breaking the stream, whichever came first) and released its blocks.
        outcomes = ('decode_abort', 'stream_broken')
        assert wait_until(lambda: sum(prefill.metric(f'kvrelay:kv_handoffs_total{{outcome="{o}"}}')
                                      for o in outcomes) == 1)
        assert prefill.metric('kvrelay:kv_handoffs_total{outcome="ack"}') == 0
        for worker in (prefill, decode):
            assert wait_until(lambda w=worker: w.metric("kvrelay:kv_cache_usage_perc") == 0.0
                              and w.metric("kvrelay:num_requests_running") == 0), worker.role
        assert decode.generation_tokens() == 0  # nothing was generated for the expired request
    finally:
        gw.stop()
        prefill.stop()
        decode.stop()
