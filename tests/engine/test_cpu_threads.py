"""The CPU engine's torch thread count: cgroup quota, affinity, serve's reserved CPU, overrides."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from kvrelay.engine.cpu_threads import cgroup_cpu_limit, plan_threads, split_cpus, usable_cpus

from tests.engine.helpers import serve


def _affinity() -> int:
    return len(os.sched_getaffinity(0))


def test_cgroup_v2_quota_is_read_in_cpus(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None


def test_cgroup_v1_quota_is_read_when_there_is_no_v2_file(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(tmp_path) == 3.0
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")  # v1's "no limit"
    assert cgroup_cpu_limit(tmp_path) is None
    assert cgroup_cpu_limit(tmp_path / "absent") is None


def test_usable_cpus_is_capped_by_the_quota_rounded_down_and_at_least_one(tmp_path):
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(tmp_path) == _affinity()
    (tmp_path / "cpu.max").write_text("190000 100000\n")  # 1.9 CPUs: one thread's worth
    assert usable_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert usable_cpus(tmp_path) == 1


def test_plan_keeps_cpus_for_the_api_process_but_never_goes_below_one_thread():
    assert plan_threads(None, reserved=1, env={}, usable=8).threads == 7
    assert plan_threads(None, reserved=1, env={}, usable=2).threads == 1
    assert plan_threads(None, reserved=1, env={}, usable=1).threads == 1
    assert plan_threads(None, reserved=0, env={}, usable=4).threads == 4
    assert "1 kept for the API process" in plan_threads(None, reserved=1, env={}, usable=2).describe()


def test_the_flag_wins_and_omp_num_threads_is_left_alone():
    assert plan_threads(3, reserved=1, env={"OMP_NUM_THREADS": "1"}, usable=2).threads == 3
    plan = plan_threads(None, reserved=1, env={"OMP_NUM_THREADS": "5"}, usable=8)
    assert plan.threads is None and "OMP_NUM_THREADS=5" in plan.describe()
    with pytest.raises(ValueError, match="--cpu-threads must be at least 1"):
        plan_threads(0)


def test_split_between_two_workers_and_the_gateway():
    assert split_cpus(2, reserved=1, usable=9) == 4
    assert split_cpus(2, reserved=1, usable=2) == 1
    assert split_cpus(2, reserved=1, usable=1) == 1


def _threads_in_engine(*flags: str, env: dict) -> str:
    code = ("import sys, torch\nfrom kvrelay.engine.engine_args import EngineArgs\n"
            "from kvrelay.engine.llm_engine import LLMEngine\nimport argparse\n"
            "p = argparse.ArgumentParser(); EngineArgs.add_cli_args(p)\n"
            "LLMEngine(EngineArgs.from_cli(p.parse_args(sys.argv[1:])))\nprint(torch.get_num_threads())\n")
    out = subprocess.run([sys.executable, "-c", code, *flags], check=False, capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[-1]


def test_the_engine_sets_torchs_threads_from_the_flag_and_otherwise_from_usable_cpus():
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    assert _threads_in_engine("--cpu-threads", "1", env=env) == "1"
    assert _threads_in_engine("--cpu-threads", "3", env=env) == "3"
    assert _threads_in_engine(env=env) == str(usable_cpus())


def test_cli_refuses_zero_threads():
    out = subprocess.run([sys.executable, "-m", "kvrelay.cli", "generate", "--cpu-threads", "0", "--prompt", "x"],
                         check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--cpu-threads: must be at least 1, got 0" in out.stderr


def test_serve_keeps_one_cpu_for_its_api_process(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    usable = usable_cpus()
    with serve(tmp_path / "serve.log", "--log-level", "info"):
        pass
    log = (tmp_path / "serve.log").read_text()
    expected = f"CPU threads: {max(1, usable - 1)} ({usable} usable CPUs"
    assert expected in log, log
    assert ("1 kept for the API process" in log) == (usable > 1)
