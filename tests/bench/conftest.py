"""Fixtures of the bench tests: one real `kvrelay serve` (bundled model, two tenants) per module."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gateway"))  # gateway_helpers: GatewayProcess

from bench_helpers import ALICE_KEY, BOB_KEY, BOB_RPM


@pytest.fixture(scope="module")
def own_tmp():
    with tempfile.TemporaryDirectory(prefix="kvrelay-bench-") as d:
        yield Path(d)


@pytest.fixture(scope="module")
def kvrelay_server(own_tmp):
    """`kvrelay serve` in its own process: alice is unlimited, bob may send BOB_RPM requests a minute."""
    import yaml
    from gateway_helpers import GatewayProcess
    from kvrelay.gateway.tenants import hash_key

    tenants = own_tmp / "tenants.yaml"
    tenants.write_text(
        yaml.safe_dump(
            {
                "tenants": [
                    {"id": "alice", "api_keys_sha256": [hash_key(ALICE_KEY)]},
                    {
                        "id": "bob",
                        "api_keys_sha256": [hash_key(BOB_KEY)],
                        "quotas": {"requests_per_minute": BOB_RPM},
                    },
                ]
            }
        )
    )
    server = GatewayProcess(["--tenants", str(tenants)], own_tmp / "serve.log")
    yield server
    server.stop()
