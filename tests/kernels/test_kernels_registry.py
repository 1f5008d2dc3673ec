"""The registry: backend choice, lazy triton import, a clear error when Triton cannot run."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import fields

import pytest
import torch
from kvrelay.kernels import reference
from kvrelay.kernels.registry import OP_NAMES, KernelOps, get_ops


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env
    return subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=120, check=False
    )


def test_every_op_is_a_kernelops_field():
    # Optional fast paths (None where a backend has none), not in OP_NAMES.
    optional = {"fresh_prefill_attention", "rotary_and_write_kv"}
    assert {f.name for f in fields(KernelOps)} == {"backend", *optional, *OP_NAMES}


def test_torch_backend_is_the_reference():
    ops = get_ops("torch")
    assert ops.backend == "torch"
    assert ops.paged_decode_attention is reference.paged_decode_attention


def test_triton_backend_under_the_interpreter_has_every_op():
    ops = get_ops("triton")
    assert ops.backend == "triton"
    for name in OP_NAMES:
        if name in ("prepack_linear", "packed_linear"):
            continue  # GPU weights stay as loaded (cuBLAS): nothing to pack, checked below
        fn = getattr(ops, name)
        assert fn.__module__.startswith("kvrelay.kernels.triton_"), (name, fn.__module__)
    assert ops.prepack_linear(torch.randn(4, 4)) is None


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="'auto', 'torch', 'native', 'triton'"):
        get_ops("cuda")


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


@NO_CUDA
def test_registry_import_and_auto_on_cpu_do_not_import_triton():
    out = run_python(
        "import sys; from kvrelay.kernels.registry import get_ops; "
        "print(get_ops('auto').backend, 'triton' in sys.modules)"
    )
    assert out.returncode == 0, out.stderr
    from kvrelay.kernels import cpu_native

    expected = "native" if cpu_native.unavailable_reason() is None else "torch"
    assert out.stdout.split() == [expected, "False"]


@NO_CUDA
def test_forced_triton_without_cuda_or_interpreter_fails_clearly():
    out = run_python("from kvrelay.kernels.registry import get_ops; get_ops('triton')")
    assert out.returncode != 0
    assert "TRITON_INTERPRET=1" in out.stderr and "CUDA" in out.stderr
