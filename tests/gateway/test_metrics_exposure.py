"""Metrics exposure: tenant ids and usage stay off the public API port; the metrics port has them all."""

from __future__ import annotations

import httpx
import pytest
from gateway_helpers import GatewayProcess, free_port, write_tenants
from kvrelay.gateway.metrics import GatewayMetrics
from kvrelay.gateway.tenants import hash_key

MODEL = "stories260K"
TENANT = "acme-secret-customer"


@pytest.fixture(scope="module")
def gw(own_tmp):
    tenants = write_tenants(own_tmp / "tenants.yaml", [
        {"id": TENANT, "api_keys_sha256": [hash_key("k-acme")], "quotas": {"requests_per_minute": 1000}}])
    port = free_port()
    g = GatewayProcess(["--tenants", tenants, "--metrics-port", str(port)], own_tmp / "gw.log")
    g.metrics_port = port
    r = httpx.post(g.url + "/v1/completions", json={"model": MODEL, "prompt": "Once", "max_tokens": 3},
                   headers={"x-api-key": "k-acme"}, timeout=60)
    assert r.status_code == 200
    yield g
    g.stop()


def test_api_port_metrics_need_a_key_and_show_no_tenant_id(gw):
    assert httpx.get(gw.url + "/metrics", timeout=10).status_code == 401
    r = httpx.get(gw.url + "/metrics", headers={"x-api-key": "k-acme"}, timeout=10)
    assert r.status_code == 200
    assert TENANT not in r.text and "tenant=" not in r.text
    # Usage is still there, summed over tenants.
    line = next(x for x in r.text.splitlines() if x.startswith("kvrelay:generation_tokens_total{"))
    assert float(line.rsplit(" ", 1)[1]) == 3


def test_metrics_port_serves_the_per_tenant_series(gw):
    text = httpx.get(f"http://127.0.0.1:{gw.metrics_port}/metrics", timeout=10).text
    assert f'kvrelay:generation_tokens_total{{model="{MODEL}",tenant="{TENANT}"}} 3.0' in text


def test_per_tenant_series_can_be_turned_off():
    m = GatewayMetrics(per_tenant=False)
    m.prompt_tokens.labels(MODEL, m.tenant(TENANT)).inc(5)
    text = m.exposition().decode()
    assert TENANT not in text and 'tenant="all"' in text
