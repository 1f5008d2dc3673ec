"""benchmarks/kernels_gpu.py must keep working: its --cpu-smoke mode runs every case at tiny shapes in
the interpreter, checking each kernel against its reference, so the GPU script cannot rot unseen."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_benchmark_script_cpu_smoke_runs_every_kernel_correctly():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernels_gpu.py"), "--cpu-smoke", "--sweep"],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    for kernel in ("decode_attention", "prefill_attention", "rms_norm", "fused_add_rms_norm", "silu_and_mul",
                   "rotary_embedding", "write_kv", "rotary_and_write_kv", "gather_blocks", "scatter_blocks", "kv_checksum", "quantize_int8",
                   "int8_matmul", "fused_moe", "fused_moe_fp8"):
        assert any(line.startswith(kernel + " ") and line.endswith(" yes") for line in lines), kernel
    assert any(line.startswith("decode_attention[stages=5]") for line in lines)
    assert any(line.startswith("prefill_attention[128x128 w8 s2]") for line in lines)
    assert "all correct" in lines[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script runs the full benchmark")
def test_benchmark_script_without_gpu_says_how_to_smoke_test():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernels_gpu.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert out.returncode == 2
    assert "--cpu-smoke" in out.stderr
