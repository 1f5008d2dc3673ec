"""benchmarks/kv_shm_floor.py must keep running against the code it measures (chunk_wire's
place_chunk, the native scatter, the direct copy out of a shared cache): a tiny run checks every
hand-off's hash on the decode side, on both paths, hot and after both processes swept their caches."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_floor_benchmark_moves_verified_kv_between_two_processes():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kv_shm_floor.py"), "--lengths", "16,40",
                          "--runs", "3", "--cold-mib", "4"], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line for line in out.stdout.splitlines() if "tokens (" in line]
    assert [row.split()[0] for row in rows] == ["16", "40"], out.stdout
    for row in rows:
        for column in ("one process", "region hot", "region cold", "direct hot", "direct cold", "direct vs region cold"):
            assert column in row, out.stdout
