"""The tenants file: parsing, specific errors, key lookup by hash, header forms."""

from __future__ import annotations

import pytest
from kvrelay.gateway.tenants import (
    TenantConfigError,
    TenantRegistry,
    hash_key,
    key_from_headers,
    parse_tenants,
)


def test_keys_resolve_to_their_tenant_and_only_hashes_are_stored(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text(f"""
tenants:
  - id: acme
    api_keys_sha256: ["{hash_key('k1')}", "{hash_key('k2')}"]
    priority: 2
    allowed_models: [stories260K]
    quotas: {{requests_per_minute: 10, tokens_per_day: null}}
  - id: beta
    api_keys_sha256: ["{hash_key('k3').upper()}"]
""")
    reg = TenantRegistry(path)
    assert reg.authenticate("k1").id == "acme" and reg.authenticate("k2").id == "acme"
    assert reg.authenticate("k3").id == "beta"
    assert reg.authenticate("k4") is None and reg.authenticate(None) is None and reg.authenticate("") is None
    acme = reg.get("acme")
    assert acme.priority == 2 and acme.quotas.requests_per_minute == 10 and acme.quotas.tokens_per_day is None
    assert acme.may_use("stories260K") and not acme.may_use("other")
    assert "k1" not in repr(acme)


def test_open_registry_has_one_unlimited_default_tenant():
    reg = TenantRegistry(None)
    assert reg.authenticate(None).id == "default" == reg.authenticate("anything").id
    assert reg.authenticate(None).may_use("any-model")


@pytest.mark.parametrize("doc,message", [
    ({}, "list under `tenants`"),
    ({"tenants": [{"id": ""}]}, "id: expected a non-empty string"),
    ({"tenants": [{"id": "a"}, {"id": "a"}]}, "duplicate tenant id"),
    ({"tenants": [{"id": "a", "api_keys_sha256": ["abc"]}]}, "64-digit hex"),
    ({"tenants": [{"id": "a", "quotas": {"rpm": 5}}]}, "quotas"),
    ({"tenants": [{"id": "a", "quotas": {"requests_per_minute": -1}}]}, "requests_per_minute"),
    ({"tenants": [{"id": "a", "priority": "high"}]}, "priority"),
    ({"tenants": [{"id": "a", "keys": []}]}, "unknown fields"),
])
def test_malformed_files_name_the_tenant_and_field(doc, message):
    with pytest.raises(TenantConfigError, match=message):
        parse_tenants(doc)


def test_key_headers():
    assert key_from_headers({"authorization": "Bearer  sk-1 "}) == "sk-1"
    assert key_from_headers({"authorization": "bearer sk-2"}) == "sk-2"
    assert key_from_headers({"x-api-key": "sk-3"}) == "sk-3"
    assert key_from_headers({"authorization": "Basic abc"}) is None
    assert key_from_headers({}) is None
