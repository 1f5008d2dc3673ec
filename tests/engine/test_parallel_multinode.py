"""Ranks on two "nodes" (two process trees on localhost): the engine hosts node 0's ranks and
`kvrelay parallel-worker` the rest, over TCP with a shared token. Greedy tokens equal one process
at TP=2 and PP=2 split 1+1; kill -9 of the follower node fails the engine naming the rank; a node
that does not join (or has the wrong token) is a clear start-up error."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers import PROMPTS, greedy, make_engine, run_engine
from kvrelay.engine.parallel.executor import WorkerDiedError
from kvrelay.engine.parallel.multinode import MultinodeError

from kvrelay.models import BUNDLED_MODEL

N = 6
KV = {"kv_cache_memory": 4 << 20}
TOKEN = "test-token"


def _two_free_ports() -> int:
    """A port p with p + 1 free too (rendezvous and control)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two consecutive free ports")


def _follower(port: int, token: str = TOKEN, log=None) -> subprocess.Popen:
    env = os.environ | {"KVRELAY_PARALLEL_TOKEN": token, "KVRELAY_PARALLEL_JOIN_TIMEOUT_S": "60"}
    return subprocess.Popen([sys.executable, "-m", "kvrelay.cli", "parallel-worker", "--nnodes", "2", "--node-rank",
                             "1", "--dist-init-addr", f"127.0.0.1:{port}"], env=env, stdout=log, stderr=log)


def _leader(port: int, **kw):
    return make_engine(BUNDLED_MODEL, nnodes=2, dist_init_addr=f"127.0.0.1:{port}", **KV, **kw)


def _requests():
    return {str(i): (p, greedy(N)) for i, p in enumerate(PROMPTS[:3])}


@pytest.fixture(scope="module")
def reference():
    return run_engine(make_engine(BUNDLED_MODEL, **KV), _requests())


@pytest.fixture
def token(monkeypatch):
    monkeypatch.setenv("KVRELAY_PARALLEL_TOKEN", TOKEN)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_two_nodes_match_one_process(reference, token, tmp_path, tp, pp):
    port = _two_free_ports()
    with open(tmp_path / "follower.log", "w") as log:
        follower = _follower(port, log=log)
        try:
            engine = _leader(port, tensor_parallel_size=tp, pipeline_parallel_size=pp)
            try:
                assert len(engine.executor.pids) == 1  # node 0 hosts rank 0 only
                assert run_engine(engine, _requests()) == reference
                assert engine.stats().parallel_ranks[1].forward.count > 0  # the remote rank reports too
            finally:
                engine.close()
            assert follower.wait(timeout=30) == 0, (tmp_path / "follower.log").read_text()
        finally:
            follower.kill()
            follower.wait()


def test_killed_follower_fails_the_engine_naming_the_rank(token, tmp_path):
    port = _two_free_ports()
    with open(tmp_path / "follower.log", "w") as log:
        follower = _follower(port, log=log)
        try:
            engine = _leader(port, tensor_parallel_size=2)
            try:
                engine.add_request("Once upon a time", greedy(400), "r")
                engine.step()
                os.kill(follower.pid, signal.SIGKILL)
                deadline = time.monotonic() + 30
                with pytest.raises(WorkerDiedError, match=r"rank 1 .*node 1"):
                    while time.monotonic() < deadline:
                        engine.step()
                deadline = time.monotonic() + 10
                while any(p.is_alive() for p in engine.executor.procs) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert not any(p.is_alive() for p in engine.executor.procs)  # node 0's rank is stopped too
            finally:
                engine.close()
        finally:
            follower.kill()
            follower.wait()


def test_a_node_that_does_not_join_is_a_clear_error(token, tmp_path, monkeypatch):
    monkeypatch.setenv("KVRELAY_PARALLEL_JOIN_TIMEOUT_S", "3")
    port = _two_free_ports()
    with open(tmp_path / "follower.log", "w") as log:
        follower = _follower(port, token="wrong", log=log)
        try:
            with pytest.raises(MultinodeError, match=r"nodes \[1\] did not join .*kvrelay parallel-worker --nnodes 2 "
                               r"--node-rank 1"):
                _leader(port, tensor_parallel_size=2)
            assert follower.wait(timeout=30) == 2
        finally:
            follower.kill()
            follower.wait()
    assert "KVRELAY_PARALLEL_TOKEN differs" in (tmp_path / "follower.log").read_text()


def test_multinode_flags_are_checked(token):
    with pytest.raises(ValueError, match="needs --dist-init-addr"):
        make_engine(BUNDLED_MODEL, tensor_parallel_size=2, nnodes=2, **KV)
    with pytest.raises(ValueError, match="cannot be split evenly over --nnodes 2"):
        make_engine(BUNDLED_MODEL, tensor_parallel_size=3, nnodes=2, dist_init_addr="127.0.0.1:1", **KV)
    with pytest.raises(ValueError, match="run `kvrelay parallel-worker --nnodes 2 --node-rank 1"):
        make_engine(BUNDLED_MODEL, tensor_parallel_size=2, nnodes=2, node_rank=1, dist_init_addr="127.0.0.1:1",
                    **KV)
