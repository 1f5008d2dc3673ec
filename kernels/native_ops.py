"""The CPU kernel set: the torch references, with decode attention from the native C kernel
(kvrelay.kernels.cpu_native) for the dtypes and layouts it supports."""

from __future__ import annotations

import torch
from kvrelay.kernels import cpu_native, reference
from kvrelay.kernels.reference import (
    fused_add_rms_norm,
    gather_blocks,
    int8_matmul,
    paged_prefill_attention,
    quantize_int8,
    rms_norm,
    rotary_embedding,
    scatter_blocks,
    silu_and_mul,
    write_kv,
)

__all__ = [
    "fused_add_rms_norm",
    "gather_blocks",
    "int8_matmul",
    "paged_decode_attention",
    "paged_prefill_attention",
    "quantize_int8",
    "rms_norm",
    "rotary_embedding",
    "scatter_blocks",
    "silu_and_mul",
    "write_kv",
]


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    if cpu_native.supports_decode(q, k_cache, v_cache):
        return cpu_native.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
