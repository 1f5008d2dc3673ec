"""Fixtures for the gateway tests: a real redis-server per test, a real open gateway per module."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from gateway_helpers import InProcessGateway, RedisServer


@pytest.fixture
def redis_server():
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: run scripts/ci.d/10-redis.sh")
    server = RedisServer()
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def open_gateway():
    gw = InProcessGateway()
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def own_tmp():
    """A temporary folder outside pytest's basetemp, which concurrent pytest runs may rotate away
    while our gateway processes still read their tenants file and write their logs."""
    with tempfile.TemporaryDirectory(prefix="kvrelay-gateway-") as d:
        yield Path(d)
