"""The CPU kernel set: the torch references, with decode attention, RMSNorm, rotary embedding,
the KV write, the block scatter of a P/D hand-off and (on AVX2 machines) linear layers over
packed weights from the native C kernels (kvrelay.kernels.cpu_native) for the dtypes and layouts
they support (decode attention, KV write and block scatter: fp32/bf16/fp16; the rest: fp32).
SiLU-and-mul stays torch: its vectorised exp beat a C loop over glibc's scalar expf 3x."""

from __future__ import annotations

import torch
from kvrelay.kernels import cpu_native, reference
from kvrelay.kernels.moe_reference import fused_moe
from kvrelay.kernels.reference import (
    PackedWeight,
    fp8_linear,
    gather_blocks,
    gelu_tanh_and_mul,
    int8_matmul,
    paged_prefill_attention,
    quantize_fp8,
    quantize_int8,
    silu_and_mul,
)

__all__ = [
    "fp8_linear",
    "fused_add_rms_norm",
    "fused_moe",
    "gather_blocks",
    "gelu_tanh_and_mul",
    "int8_matmul",
    "packed_linear",
    "paged_decode_attention",
    "paged_prefill_attention",
    "prepack_linear",
    "quantize_fp8",
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
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    if cpu_native.supports_decode(q, k_cache, v_cache):
        return cpu_native.paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, window, softcap)
    return reference.paged_decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, scale, window=window, softcap=softcap
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if cpu_native.supports_norm(x, weight):
        return cpu_native.add_rms_norm(x, None, weight, eps)[0]
    return reference.rms_norm(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if cpu_native.supports_norm(x, weight, residual):
        return cpu_native.add_rms_norm(x, residual, weight, eps)
    return reference.fused_add_rms_norm(x, residual, weight, eps)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if cpu_native.supports_rotary(positions, q, k, cos_sin_cache):
        return cpu_native.rotary_embedding(positions, q, k, cos_sin_cache)
    return reference.rotary_embedding(positions, q, k, cos_sin_cache)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if cpu_native.supports_write_kv(key, value, k_cache, v_cache, slot_mapping):
        return cpu_native.write_kv(key, value, k_cache, v_cache, slot_mapping)
    return reference.write_kv(key, value, k_cache, v_cache, slot_mapping)


def scatter_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor, layer_start: int, layer_end: int
) -> None:
    if cpu_native.supports_scatter_blocks(kv_cache, block_ids, buffer, layer_start, layer_end):
        return cpu_native.scatter_blocks(kv_cache, block_ids, buffer, layer_start, layer_end)
    return reference.scatter_blocks(kv_cache, block_ids, buffer, layer_start, layer_end)


def copy_blocks(dst_cache: torch.Tensor, dst_ids: torch.Tensor, src_cache: torch.Tensor, src_ids: torch.Tensor,
                layer_start: int, layer_end: int) -> None:
    """Not a registry op: the same-node direct hand-off's copy between two CPU caches."""
    if cpu_native.supports_copy_blocks(dst_cache, dst_ids, src_cache, src_ids, layer_start, layer_end):
        return cpu_native.copy_blocks(dst_cache, dst_ids, src_cache, src_ids, layer_start, layer_end)
    return reference.copy_blocks(dst_cache, dst_ids, src_cache, src_ids, layer_start, layer_end)


def prepack_linear(weight: torch.Tensor) -> PackedWeight | None:
    """fp32 CPU weights packed for the native kernel where this machine has it (see csrc/linear.c)."""
    fits = weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
    return reference.pack_linear_weight(weight) if fits and cpu_native.packed_linear_available() else None


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    data = packed.data
    native = data.device.type == "cpu" and data.dtype == x.dtype == torch.float32 and data.is_contiguous()
    if native and (bias is None or bias.dtype == torch.float32) and cpu_native.packed_linear_available():
        return cpu_native.packed_linear(x, packed, None if bias is None else bias.contiguous())
    return reference.packed_linear(x, packed, bias)
