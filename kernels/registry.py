"""The one place the engine gets kernels from: Triton on CUDA, torch references otherwise.

`get_ops("auto" | "torch" | "triton")` returns a KernelOps whose functions share the
signatures documented in kvrelay.kernels.reference.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable

from kvrelay.kernels import reference

OP_NAMES = (
    "rms_norm",
    "fused_add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "write_kv",
    "paged_decode_attention",
    "paged_prefill_attention",
    "gather_blocks",
    "scatter_blocks",
    "quantize_int8",
    "int8_matmul",
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


def _from_module(backend: str, module: types.ModuleType) -> KernelOps:
    return KernelOps(backend=backend, **{name: getattr(module, name) for name in OP_NAMES})


def get_ops(backend: str = "auto") -> KernelOps:
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"kernel backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "auto":
        import torch

        backend = "triton" if torch.cuda.is_available() else "torch"
    if backend == "torch":
        return _from_module("torch", reference)
    raise ValueError("the triton kernel backend is not available yet")
