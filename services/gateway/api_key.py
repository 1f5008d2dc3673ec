"""`--api-key` (or KVRELAY_API_KEY): a one-key server without a tenants file, as vLLM's flag.

One unlimited `default` tenant whose only key is the given one. Only the key's sha256 is kept and a
presented key is compared with `hmac.compare_digest` (TenantRegistry.authenticate); the key is
never logged. Prefer the environment variable: a command-line flag is visible in the process list.
"""

from __future__ import annotations

import hashlib

from kvrelay.gateway.tenants import DEFAULT_TENANT_ID, Tenant, TenantRegistry

ENV = "KVRELAY_API_KEY"


class ApiKeyRegistry(TenantRegistry):
    def __init__(self, key: str):
        if not key or key != key.strip():
            raise ValueError("--api-key: must be non-empty, without surrounding whitespace")
        super().__init__(None)
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
        # No other tenant to protect: any request priority is allowed.
        self._tenants = [Tenant(DEFAULT_TENANT_ID, (digest,), max_request_priority=None)]
        self._by_id = {DEFAULT_TENANT_ID: self._tenants[0]}

    @property
    def open(self) -> bool:
        return False  # a key is required

    def __repr__(self) -> str:  # never the key, nor its hash
        return "ApiKeyRegistry(<one key>)"
