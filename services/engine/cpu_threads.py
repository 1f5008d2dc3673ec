"""How many threads torch runs a CPU engine's forward on.

torch's default is the machine's physical cores. Two things make that wrong where kvrelay runs:
- a container's CPU limit (cgroup `cpu.max`) is often far below the node's cores, and more
  threads than the quota allows get throttled at every barrier;
- `kvrelay serve` has an API process beside the engine: on a 2-core machine an engine on both
  cores is slowed by every HTTP chunk the API process writes (OpenMP threads wait for the one that
  was descheduled), which doubled the latency serve adds (docs/benchmarks.md). vLLM's CPU backend
  keeps one core for its API process for the same reason.

So the default is the CPUs this process may use (affinity mask and cgroup quota), less the ones
kept for processes beside the engine. `--cpu-threads` overrides it, and so does OMP_NUM_THREADS
when set (torch read it at start-up; it is left alone).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (v2 cpu.max, else v1 cfs quota); None: no limit."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # cgroup v2: "max 100000" or "200000 100000"
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # cgroup v1
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """CPUs this process can keep busy: its affinity mask, capped by the cgroup quota (at least 1)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        cpus = min(cpus, math.floor(limit))  # a fraction of a CPU is not a thread's worth
    return max(1, cpus)


@dataclass(frozen=True)
class ThreadPlan:
    threads: int | None  # None: leave torch's count as it is (OMP_NUM_THREADS chose it)
    reason: str

    def describe(self) -> str:
        return f"CPU threads: {self.threads if self.threads is not None else 'as OMP_NUM_THREADS'} ({self.reason})"


def plan_threads(requested: int | None, reserved: int = 0, env: dict | None = None,
                 usable: int | None = None) -> ThreadPlan:
    """requested: --cpu-threads; reserved: CPUs kept for processes beside the engine (serve's API)."""
    env = os.environ if env is None else env
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--cpu-threads must be at least 1, got {requested}")
        return ThreadPlan(requested, "--cpu-threads")
    if env.get("OMP_NUM_THREADS"):
        return ThreadPlan(None, f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}")
    usable = usable_cpus() if usable is None else usable
    kept = _kept(reserved, usable)
    reason = f"{usable} usable CPUs"
    if kept:
        reason += f", {kept} kept for the API process"
    return ThreadPlan(usable - kept, reason)


def split_cpus(parts: int, reserved: int = 0, usable: int | None = None) -> int:
    """Threads for each of `parts` engines sharing this machine with `reserved` CPUs kept aside."""
    usable = usable_cpus() if usable is None else usable
    return max(1, (usable - _kept(reserved, usable)) // parts)


def _kept(reserved: int, usable: int) -> int:
    """CPUs kept aside: at most `reserved`, and never the engine's last one."""
    return min(reserved, usable - 1)
