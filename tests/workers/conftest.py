"""Fixtures of the prefill/decode worker tests (helpers live in pd_helpers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pd_helpers import WorkerProcess, save_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture
def spawn():
    """spawn(role, *args, **kw) -> WorkerProcess; every process is killed at teardown."""
    procs: list[WorkerProcess] = []

    def _spawn(role: str, *args: str, **kw) -> WorkerProcess:
        w = WorkerProcess(role, *args, **kw)
        procs.append(w)
        return w

    yield _spawn
    for w in procs:
        w.kill()
