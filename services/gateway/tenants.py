"""Tenants: who may call the gateway, with which keys, quotas, priority and models.

The tenants file is YAML (in a cluster it is mounted from a Kubernetes Secret):

    tenants:
      - id: acme
        api_keys_sha256: ["<hex sha256 of the key>", ...]
        priority: 1                 # higher is served first; fairness applies within a priority
        max_request_priority: 0     # optional: the highest `priority` its requests may ask for (default 0)
        allowed_models: ["*"]       # or a list of served model ids
        prefix_cache_group: team-a  # optional: tenants naming the same group share cached prefixes
        request_timeout_s: 60       # optional: caps the gateway's --request-timeout for this tenant
        quotas:                     # every quota is optional; absent means unlimited
          requests_per_minute: 600
          tokens_per_minute: 200000
          concurrent_requests: 32
          tokens_per_day: 50000000

Only hashes of keys are stored; a presented key is hashed and compared against every stored
hash with `hmac.compare_digest`, so neither the comparison time nor logs reveal a key. The
file is re-read when its modification time changes (checked at most once per
`reload_interval_s`), so rotating keys needs no restart; a file that fails to parse is
reported and the previous tenants stay in force.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

log = logging.getLogger(__name__)

DEFAULT_TENANT_ID = "default"
QUOTA_FIELDS = ("requests_per_minute", "tokens_per_minute", "concurrent_requests", "tokens_per_day")


@dataclass(frozen=True)
class Quotas:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    concurrent_requests: int | None = None
    tokens_per_day: int | None = None


@dataclass(frozen=True)
class Tenant:
    id: str
    key_hashes: tuple[bytes, ...] = ()
    quotas: Quotas = field(default_factory=Quotas)
    priority: int = 0
    allowed_models: tuple[str, ...] = ("*",)
    prefix_cache_group: str | None = None  # None: a prefix cache of its own
    # A request's `priority` orders it among its tenant's own requests, up to this (None: unbounded).
    max_request_priority: int | None = 0
    request_timeout_s: float | None = None  # caps the gateway's --request-timeout for this tenant

    def may_use(self, model: str) -> bool:
        return "*" in self.allowed_models or model in self.allowed_models


class TenantConfigError(ValueError):
    """The tenants file is malformed; the message names the tenant and field."""


def hash_key(key: str) -> str:
    """The hex sha256 of an API key, as stored in the tenants file."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def parse_tenants(doc: object, source: str = "tenants file") -> list[Tenant]:
    if not isinstance(doc, dict) or not isinstance(doc.get("tenants"), list):
        raise TenantConfigError(f"{source}: expected a mapping with a list under `tenants`")
    tenants: list[Tenant] = []
    seen: set[str] = set()
    for i, entry in enumerate(doc["tenants"]):
        where = f"{source}: tenants[{i}]"
        if not isinstance(entry, dict):
            raise TenantConfigError(f"{where}: expected a mapping")
        unknown = set(entry) - {"id", "api_keys_sha256", "priority", "allowed_models", "quotas", "prefix_cache_group",
                                "max_request_priority",
                                "request_timeout_s"}
        if unknown:
            raise TenantConfigError(f"{where}: unknown fields {sorted(unknown)}")
        tid = entry.get("id")
        if not isinstance(tid, str) or not tid:
            raise TenantConfigError(f"{where}.id: expected a non-empty string")
        if tid in seen:
            raise TenantConfigError(f"{where}.id: duplicate tenant id {tid!r}")
        seen.add(tid)
        where = f"{source}: tenant {tid!r}"
        hashes = entry.get("api_keys_sha256", [])
        if not isinstance(hashes, list):
            raise TenantConfigError(f"{where}.api_keys_sha256: expected a list of hex sha256 digests")
        key_hashes = []
        for h in hashes:
            try:
                raw = bytes.fromhex(h) if isinstance(h, str) else b""
            except ValueError:
                raw = b""
            if len(raw) != 32:
                raise TenantConfigError(f"{where}.api_keys_sha256: {str(h)[:8]}... is not a 64-digit hex sha256")
            key_hashes.append(raw)
        priority = entry.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise TenantConfigError(f"{where}.priority: expected an integer, got {priority!r}")
        models = entry.get("allowed_models", ["*"])
        if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
            raise TenantConfigError(f"{where}.allowed_models: expected a list of model ids or ['*']")
        quotas = entry.get("quotas", {}) or {}
        if not isinstance(quotas, dict) or set(quotas) - set(QUOTA_FIELDS):
            raise TenantConfigError(f"{where}.quotas: expected a mapping with keys among {QUOTA_FIELDS}")
        for name, value in quotas.items():
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise TenantConfigError(f"{where}.quotas.{name}: expected an integer >= 0 or null, got {value!r}")
        max_request = entry.get("max_request_priority", 0)
        if not isinstance(max_request, int) or isinstance(max_request, bool):
            raise TenantConfigError(f"{where}.max_request_priority: expected an integer, got {max_request!r}")
        group = entry.get("prefix_cache_group")
        if group is not None and (not isinstance(group, str) or not group):
            raise TenantConfigError(f"{where}.prefix_cache_group: expected a non-empty string, got {group!r}")
        timeout = entry.get("request_timeout_s")
        if timeout is not None and (not isinstance(timeout, (int, float)) or isinstance(timeout, bool)
                                    or timeout <= 0):
            raise TenantConfigError(f"{where}.request_timeout_s: expected seconds > 0, got {timeout!r}")
        tenants.append(Tenant(tid, tuple(key_hashes), Quotas(**quotas), priority, tuple(models),
                              None if group is None else f"group:{group}", max_request,
                              timeout))
    return tenants


class TenantRegistry:
    """Resolves a presented API key to a tenant; reloads its file when it changes.

    With no file (`path=None`) the registry is open: every request, with or without a key,
    belongs to one unlimited `default` tenant (the single-process `kvrelay serve` mode).
    """

    def __init__(self, path: str | Path | None = None, reload_interval_s: float = 1.0):
        self.path = Path(path) if path else None
        self.reload_interval_s = reload_interval_s
        self._tenants: list[Tenant] = [Tenant(DEFAULT_TENANT_ID, max_request_priority=None)] if self.path is None else []
        self._by_id = {t.id: t for t in self._tenants}
        self._mtime: float | None = None
        self._checked_at = 0.0
        if self.path is not None:
            self._load()  # a broken file at start-up is fatal: raise to the caller

    @property
    def open(self) -> bool:
        return self.path is None

    @property
    def tenants(self) -> list[Tenant]:
        self.maybe_reload()
        return list(self._tenants)

    def get(self, tenant_id: str) -> Tenant | None:
        self.maybe_reload()
        return self._by_id.get(tenant_id)

    def _load(self) -> None:
        assert self.path is not None
        mtime = os.stat(self.path).st_mtime_ns
        with open(self.path, encoding="utf-8") as f:
            tenants = parse_tenants(yaml.safe_load(f), str(self.path))
        self._tenants, self._by_id, self._mtime = tenants, {t.id: t for t in tenants}, mtime
        log.info("loaded %d tenants from %s", len(tenants), self.path)

    def maybe_reload(self) -> None:
        if self.path is None:
            return
        now = time.monotonic()
        if now - self._checked_at < self.reload_interval_s:
            return
        self._checked_at = now
        try:
            if os.stat(self.path).st_mtime_ns != self._mtime:
                self._load()
        except (OSError, yaml.YAMLError, TenantConfigError) as e:
            log.error("tenants file not reloaded, keeping the previous tenants: %s", e)

    def authenticate(self, key: str | None) -> Tenant | None:
        """The tenant owning `key`, or None. Compares against every hash (no early exit)."""
        self.maybe_reload()
        if self.open:
            return self._tenants[0]
        if not key:
            return None
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
        found = None
        for tenant in self._tenants:
            for stored in tenant.key_hashes:
                if hmac.compare_digest(digest, stored) and found is None:
                    found = tenant
        return found


def key_from_headers(headers) -> str | None:
    """The API key from `Authorization: Bearer <key>` or `x-api-key: <key>`."""
    auth = headers.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    key = headers.get("x-api-key")
    return key.strip() if key else None
