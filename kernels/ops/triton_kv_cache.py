"""KV cache movement: write new tokens into their slots, and pack/unpack whole blocks for hand-off.

Block ids are int32/int64 tensors; offsets are computed in int64 because a whole-model cache
easily exceeds 2**31 elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvrelay.kernels.triton_common import on_device, pow2


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    key_tok_stride, key_head_stride, value_tok_stride, value_head_stride,
    cache_block_stride, cache_slot_stride, cache_head_stride,
    block_size, num_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # slot < 0 marks padding tokens: nothing is written for them.
    d_limit = tl.where(slot >= 0, head_dim, 0)
    mask = (h < num_heads)[:, None] & (d < d_limit)[None, :]
    slot = tl.maximum(slot, 0)
    dst = (slot // block_size) * cache_block_stride + (slot % block_size) * cache_slot_stride
    dst = dst + h[:, None] * cache_head_stride + d[None, :]
    k = tl.load(key_ptr + tok * key_tok_stride + h[:, None] * key_head_stride + d[None, :], mask=mask)
    v = tl.load(value_ptr + tok * value_tok_stride + h[:, None] * value_head_stride + d[None, :], mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("write_kv needs K and V caches with the same strides and a unit stride on head_dim")
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    slot_mapping = on_device(slot_mapping, k_cache.device)
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], num_heads, head_dim,
        BLOCK_H=pow2(num_heads), BLOCK_D=pow2(head_dim), num_warps=4,
    )


@triton.jit(do_not_specialize=["layer_start", "num_ids"])
def _copy_blocks_kernel(
    cache_ptr, buf_ptr, ids_ptr,
    layer_start, num_ids, chunk,
    cache_layer_stride, cache_kv_stride, cache_block_stride,
    GATHER: tl.constexpr, BLOCK: tl.constexpr,
):
    # Program (layer*2 + kv) * num_ids + i copies one block's chunk (block_size * Hkv * D elements).
    pid = tl.program_id(0)
    i = pid % num_ids
    lk = pid // num_ids
    layer = layer_start + lk // 2
    kv = lk % 2
    block_id = tl.load(ids_ptr + i).to(tl.int64)
    cache_base = layer.to(tl.int64) * cache_layer_stride + kv * cache_kv_stride
    cache_base += block_id * cache_block_stride
    buf_base = pid.to(tl.int64) * chunk
    for start in range(tl.program_id(1) * BLOCK, chunk, tl.num_programs(1) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < chunk
        if GATHER:
            x = tl.load(cache_ptr + cache_base + offs, mask=mask)
            tl.store(buf_ptr + buf_base + offs, x.to(buf_ptr.dtype.element_ty), mask=mask)
        else:
            x = tl.load(buf_ptr + buf_base + offs, mask=mask)
            tl.store(cache_ptr + cache_base + offs, x.to(cache_ptr.dtype.element_ty), mask=mask)


def _check_cache(kv_cache: torch.Tensor) -> int:
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache must be [L, 2, num_blocks, block_size, Hkv, D], got {tuple(kv_cache.shape)}"
        )
    if not kv_cache[0, 0, 0].is_contiguous() or kv_cache.stride(2) != kv_cache[0, 0, 0].numel():
        raise ValueError("kv_cache blocks must be contiguous in [block_size, Hkv, D]")
    return kv_cache.stride(2)


def _launch_copy(kv_cache, buffer, block_ids, layer_start, layer_end, gather: bool) -> None:
    chunk = _check_cache(kv_cache)
    block_ids = on_device(block_ids, kv_cache.device)
    num_ids = block_ids.numel()
    num_layers = layer_end - layer_start
    if num_ids == 0 or num_layers <= 0:
        return
    block = min(pow2(chunk), 4096)
    # Split a chunk over a few programs only when there are too few blocks to fill the GPU.
    splits = min(triton.cdiv(chunk, block), max(1, 1024 // (num_layers * 2 * num_ids)))
    grid = (num_layers * 2 * num_ids, splits)
    _copy_blocks_kernel[grid](
        kv_cache, buffer, block_ids, layer_start, num_ids, chunk,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        GATHER=gather, BLOCK=block, num_warps=4,
    )


def gather_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, layer_start: int, layer_end: int
) -> torch.Tensor:
    shape = (layer_end - layer_start, 2, block_ids.numel(), *kv_cache.shape[3:])
    buffer = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
    _launch_copy(kv_cache, buffer, block_ids, layer_start, layer_end, gather=True)
    return buffer


def scatter_blocks(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor, layer_start: int, layer_end: int
) -> None:
    expected = (layer_end - layer_start, 2, block_ids.numel(), *kv_cache.shape[3:])
    if tuple(buffer.shape) != expected:
        raise ValueError(f"buffer shape {tuple(buffer.shape)} does not match {expected}")
    # The buffer may arrive on the host (received from another worker): bring it to the cache.
    buffer = on_device(buffer, kv_cache.device)
    _launch_copy(kv_cache, buffer, block_ids, layer_start, layer_end, gather=False)
