"""Leader election on a real control plane (../shared/k8s): how long after `kill -9` of the
leading `kvrelay operator` the standby resumes, per --peering-lifetime.

Two operator processes join one ClusterKopfPeering (priorities 20 and 10); the leader is killed
with SIGKILL a few seconds after both joined, and the standby's log is polled for kopf's
"Resuming operations". The wait is the rest of the dead leader's lease: at most the lifetime.
Also prints how long the control plane took to start.

    .venv/bin/python benchmarks/operator_takeover.py [--lifetimes 6 15]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "operator"))
from real_cluster import CHART, Kube, OperatorProcess, start_cluster, stop_cluster, wait_for


def takeover_seconds(kube: Kube, kubeconfig: Path, workdir: Path, lifetime: int) -> float:
    peering = f"bench-{lifetime}"
    kube.apply({"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": peering}})
    flags = (f"--peering={peering}", f"--peering-lifetime={lifetime}")
    leader = OperatorProcess(kubeconfig, workdir / f"leader-{lifetime}.log", *flags, "--priority", "20")
    wait_for(lambda: "Resuming operations" in leader.text(), 90)
    standby = OperatorProcess(kubeconfig, workdir / f"standby-{lifetime}.log", *flags, "--priority", "10")
    try:
        wait_for(lambda: len(kube.get("clusterkopfpeering", peering, "").get("status") or {}) == 2, 90)
        time.sleep(3)
        leader.kill()
        killed = time.monotonic()
        wait_for(lambda: "Resuming operations" in standby.text(), lifetime + 60, interval=0.05)
        return time.monotonic() - killed
    finally:
        leader.kill()
        standby.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lifetimes", type=int, nargs="+", default=[6, 15])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="k8s-") as tmp:
        workdir = Path(tmp)
        started = time.monotonic()
        env = start_cluster(workdir)
        print(f"control plane up in {time.monotonic() - started:.1f} s")
        kube = Kube(env["KUBECONFIG"])
        try:
            kube.run("apply", "-f", str(CHART / "crds"))
            for lifetime in args.lifetimes:
                seconds = takeover_seconds(kube, Path(env["KUBECONFIG"]), workdir, lifetime)
                print(f"--peering-lifetime {lifetime}: the standby resumed {seconds:.1f} s after kill -9 of the leader")
        finally:
            stop_cluster(workdir)


if __name__ == "__main__":
    main()
