"""The one place the engine gets kernels from: Triton on CUDA, native C + torch on CPU.

`get_ops("auto" | "torch" | "native" | "triton")` returns a KernelOps whose functions share the
signatures documented in kvrelay.kernels.reference:
- "torch": the plain torch references, everywhere.
- "native": the references, with decode attention, norms, rotary, KV write and (AVX2 machines)
  linear layers over packed weights from C kernels compiled on first use
  (kvrelay.kernels.native_ops); CPU only.
- "triton": Triton kernels on CUDA.
- "auto": triton with CUDA; else native when it builds here, torch (with a warning) when not.

Triton is imported only when the triton backend is chosen, so CPU-only callers never pay for it.
"triton" forced without a CUDA device runs the kernels in Triton's CPU interpreter, which needs
TRITON_INTERPRET=1 in the environment before the kernels are first imported (slow: for tests).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import types
from collections.abc import Callable
from dataclasses import dataclass

from kvrelay.kernels import reference

log = logging.getLogger(__name__)
BACKENDS = ("auto", "torch", "native", "triton")

OP_NAMES = (
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "gelu_tanh_and_mul",
    "write_kv",
    "paged_decode_attention",
    "paged_prefill_attention",
    "gather_blocks",
    "scatter_blocks",
    "quantize_int8",
    "int8_matmul",
    "quantize_fp8",
    "fp8_linear",
    "prepack_linear",
    "packed_linear",
    "fused_moe",
)


@dataclass(frozen=True)
class KernelOps:
    backend: str
    rms_norm: Callable
    fused_add_rms_norm: Callable
    rotary_embedding: Callable
    silu_and_mul: Callable
    write_kv: Callable
    paged_decode_attention: Callable
    paged_prefill_attention: Callable
    gather_blocks: Callable
    scatter_blocks: Callable
    quantize_int8: Callable
    int8_matmul: Callable
    quantize_fp8: Callable
    fp8_linear: Callable
    prepack_linear: Callable
    packed_linear: Callable
    # Added after the first release: a default, so KernelOps built by keyword elsewhere still work.
    gelu_tanh_and_mul: Callable = reference.gelu_tanh_and_mul
    fused_moe: Callable = reference.fused_moe  # mixture-of-experts MLP (kvrelay.kernels.moe_reference)
    # Prefill attention of chunks without a cached prefix over their own contiguous K/V, or None
    # where it cannot serve the inputs (kvrelay.kernels.flash_prefill); None: the paged kernel only.
    fresh_prefill_attention: Callable | None = None
    # rotary_embedding then write_kv in one launch (same numbers), or None: the model calls the two.
    rotary_and_write_kv: Callable | None = None


def _from_module(backend: str, module: types.ModuleType) -> KernelOps:
    return KernelOps(backend=backend, **{name: getattr(module, name) for name in OP_NAMES})


@functools.cache
def cpu_backend() -> str:
    """"native" when the C kernels build and load on this machine, else "torch"."""
    from kvrelay.kernels import cpu_native

    reason = cpu_native.unavailable_reason()
    if reason is None:
        return "native"
    log.warning("using the torch kernels on CPU (slower decode): %s", reason)
    return "torch"


def get_ops(backend: str = "auto") -> KernelOps:
    if backend not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    if backend == "auto":
        import torch

        backend = "triton" if torch.cuda.is_available() else cpu_backend()
    if backend == "torch":
        return _from_module("torch", reference)
    if backend == "native":
        from kvrelay.kernels import cpu_native, native_ops

        cpu_native.library()  # raises NativeKernelsUnavailable, saying why
        return _from_module("native", native_ops)
    return _triton_ops()


def _triton_ops() -> KernelOps:
    import torch

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "kernel backend 'triton' needs a CUDA device; to run the Triton kernels on CPU in the "
            "interpreter, set TRITON_INTERPRET=1 in the environment before starting the process "
            "(or use kernel backend 'torch' / 'auto')"
        )
    try:
        from kvrelay.kernels import triton_ops
    except ImportError as exc:
        raise RuntimeError(f"kernel backend 'triton' needs the triton package: {exc}") from exc
    from kvrelay.kernels import flash_prefill
    from kvrelay.kernels.triton_rotary_kv import rotary_and_write_kv

    ops = dataclasses.replace(_from_module("triton", triton_ops), rotary_and_write_kv=rotary_and_write_kv)
    if flash_prefill.available():
        ops = dataclasses.replace(ops, fresh_prefill_attention=flash_prefill.fresh_prefill_attention)
    return ops
