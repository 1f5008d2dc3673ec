"""`kvrelay operator` as a real process against the emulated cluster, and leader election:
of two replicas only the one with the higher peering priority works, the other stands by."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import kmock
from kvrelay.operator import constants as c
from operator_harness import DEPLOYMENTS, eventually, isvc_body

PEERINGS = kmock.resource(group="kopf.dev", version="v1", plural="clusterkopfpeerings")


def start_operator(tmp_path: Path, name: str, *args: str) -> tuple[subprocess.Popen, Path]:
    log = tmp_path / f"{name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "kvrelay.cli", "operator", "--liveness", "", *args],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    return proc, log


async def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.to_thread(proc.wait), 20)
        except TimeoutError:
            proc.kill()
            await asyncio.to_thread(proc.wait)


async def test_kvrelay_operator_command_reconciles(cluster, tmp_path):
    await cluster.create(isvc_body())
    proc, log = start_operator(tmp_path, "solo", "--standalone")
    try:
        await eventually(lambda: cluster.live(DEPLOYMENTS, "default", "demo-gateway"), timeout=60)
    finally:
        await stop(proc)
    assert proc.returncode == 0, log.read_text()[-3000:]


async def test_only_the_elected_leader_reconciles(cluster, tmp_path):
    cluster.resources[PEERINGS] = cluster.ResourceInfo(kind="ClusterKopfPeering", namespaced=False,
                                                       verbs={"get", "list", "watch", "patch"})
    async with cluster.post("/apis/kopf.dev/v1/clusterkopfpeerings",
                            json={"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering",
                                  "metadata": {"name": c.PEERING_NAME}}) as response:
        assert response.status < 300
    standby, standby_log = start_operator(tmp_path, "standby", "--priority", "10")
    leader = None
    try:
        # Alone, the low-priority replica leads and builds the children.
        await cluster.create(isvc_body(name="first"))
        await eventually(lambda: cluster.live(DEPLOYMENTS, "default", "first-decode"), timeout=60)
        # A higher-priority replica appears: the first one pauses, the new one takes over.
        leader, leader_log = start_operator(tmp_path, "leader", "--priority", "20")
        await eventually(lambda: "Pausing operations in favour of" in standby_log.read_text(), timeout=60)
        await cluster.create(isvc_body(name="second"))
        await eventually(lambda: cluster.live(DEPLOYMENTS, "default", "second-decode"), timeout=60)
        await eventually(lambda: "second" in leader_log.read_text(), timeout=30)
        assert "second" not in standby_log.read_text()
        peers = cluster.live(PEERINGS, None, c.PEERING_NAME)["status"]
        assert sorted(p["priority"] for p in peers.values()) == [10, 20]
    finally:
        await stop(standby)
        if leader is not None:
            await stop(leader)


async def test_unreadable_peering_object_stops_the_operator_with_the_reason(cluster, tmp_path):
    """An API error on the peering object (a 403 on demand) ends start-up with what is missing."""
    cluster[f"get /apis/kopf.dev/v1/clusterkopfpeerings/{c.PEERING_NAME}"] << 403
    proc, log = start_operator(tmp_path, "denied")
    try:
        await eventually(lambda: proc.poll() is not None, timeout=60)
    finally:
        await stop(proc)
    assert proc.returncode != 0
    assert f"cannot read ClusterKopfPeering '{c.PEERING_NAME}'" in log.read_text()


def test_namespaced_mode_requires_standalone():
    out = subprocess.run([sys.executable, "-m", "kvrelay.cli", "operator", "-n", "team-a"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "--standalone" in out.stderr
