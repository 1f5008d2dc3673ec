"""Tenants made easy: `kvrelay tenants add` and a sensible reservation for requests without max_tokens."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import yaml
from gateway_helpers import InProcessGateway, write_tenants
from kvrelay.gateway.app import GatewayConfig
from kvrelay.gateway.tenants import TenantRegistry, hash_key

MODEL = "stories260K"


def tenants_add(path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrelay.cli", "tenants", "add", *args, "--file", str(path)],
                          check=False, capture_output=True, text=True, timeout=60)


def test_tenants_add_prints_a_key_once_and_stores_only_its_hash(tmp_path):
    path = tmp_path / "tenants.yaml"
    first = tenants_add(path, "acme", "--rpm", "60", "--tpm", "10000", "--concurrency", "4")
    assert first.returncode == 0, first.stderr
    key = first.stdout.strip()
    assert key.startswith("sk-kvrelay-") and len(key) > 40
    assert key not in path.read_text() and hash_key(key) in path.read_text()
    second = tenants_add(path, "beta")
    assert second.returncode == 0 and second.stdout.strip() != key
    registry = TenantRegistry(path)
    acme = registry.authenticate(key)
    assert acme.id == "acme" and (acme.quotas.requests_per_minute, acme.quotas.tokens_per_minute,
                                  acme.quotas.concurrent_requests) == (60, 10000, 4)
    assert registry.authenticate(second.stdout.strip()).id == "beta"
    again = tenants_add(path, "acme")
    assert again.returncode == 1 and "already exists" in again.stderr
    assert [t["id"] for t in yaml.safe_load(path.read_text())["tenants"]] == ["acme", "beta"]


def test_request_without_max_tokens_reserves_the_default_and_settles_at_use(tmp_path):
    tenants = write_tenants(tmp_path / "t.yaml", [
        {"id": "small", "api_keys_sha256": [hash_key("k-small")], "quotas": {"tokens_per_minute": 200}}])
    gw = InProcessGateway(tenants, GatewayConfig(default_reserve_tokens=50))
    try:
        # Without the default, the reservation would be the whole context (> 200 tokens): a 400.
        assert gw.gateway.backend.max_model_len > 200
        r = httpx.post(gw.url + "/v1/chat/completions", headers={"x-api-key": "k-small"}, timeout=120,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "Once upon a time"}]})
        assert r.status_code == 200, r.text
        used = r.json()["usage"]["total_tokens"]
        usage = asyncio.run(gw.gateway.quota.store.usage("small"))
        assert usage["tokens_per_minute"] == used and usage["concurrent_requests"] == 0
    finally:
        gw.stop()
