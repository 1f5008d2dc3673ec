"""Rotary embedding and the KV-cache write in one launch: what the model's layer_qkv did in two.

A decode step runs this once per layer, so fusing saves one launch per layer (16 on Llama-3.2-1B,
about 2 us each in a CUDA graph) and a round trip of K through memory: the rotated K goes to the
cache from registers. The numbers are those of rotary_embedding then write_kv, bit for bit: K is
rounded to its own dtype before the cache's, as the two ops round it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvrelay.kernels.triton_common import on_device, pow2
from kvrelay.kernels.triton_rotary import head_offsets, rotate_q_and_k, store_halves


@triton.jit
def _rotary_write_kv_kernel(
    pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr, cs_ptr,
    q_tok_stride, q_head_stride, k_tok_stride, k_head_stride, v_tok_stride, v_head_stride,
    qo_tok_stride, qo_head_stride, ko_tok_stride, ko_head_stride, cs_stride,
    cache_block_stride, cache_slot_stride, cache_head_stride, block_size,
    num_q_heads, num_k_heads, half, head_dim,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    k1, k2, kmask, d = rotate_q_and_k(pos_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, cs_ptr, tok,
                                      q_tok_stride, q_head_stride, k_tok_stride, k_head_stride,
                                      qo_tok_stride, qo_head_stride, ko_tok_stride, ko_head_stride, cs_stride,
                                      num_q_heads, num_k_heads, half, BLOCK_HQ, BLOCK_HK, BLOCK_HALF)

    slot = tl.load(slot_ptr + tok).to(tl.int64)
    # slot < 0 marks padding tokens: nothing is written for them (their column limits are 0).
    half_limit = tl.where(slot >= 0, half, 0)
    d_limit = tl.where(slot >= 0, head_dim, 0)
    slot = tl.maximum(slot, 0)
    base = (slot // block_size) * cache_block_stride + (slot % block_size) * cache_slot_stride
    k_ty = k_out_ptr.dtype.element_ty
    store_halves(k_cache_ptr, base + head_offsets(0, 0, cache_head_stride, d, BLOCK_HK), half,
                 k1.to(k_ty), k2.to(k_ty), kmask & (d < half_limit)[None, :])
    h = tl.arange(0, BLOCK_HK)
    dv = tl.arange(0, BLOCK_D)
    vmask = (h < num_k_heads)[:, None] & (dv < d_limit)[None, :]
    v = tl.load(v_ptr + tok * v_tok_stride + h[:, None] * v_head_stride + dv[None, :], mask=vmask)
    tl.store(v_cache_ptr + base + h[:, None] * cache_head_stride + dv[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=vmask)


def rotary_and_write_kv(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_embedding(positions, q, k, cos_sin_cache), then write_kv(rotated k, v, k_cache,
    v_cache, slot_mapping), in one launch. Returns the rotated (q, k)."""
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    if cs.shape[-1] != head_dim:
        raise ValueError(f"cos_sin_cache has {cs.shape[-1]} columns, expected head_dim {head_dim}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("rotary_and_write_kv needs K and V caches with the same strides and a unit stride on head_dim")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    _rotary_write_kv_kernel[(num_tokens,)](
        on_device(positions, q.device), on_device(slot_mapping, k_cache.device),
        q, k, v, q_out, k_out, k_cache, v_cache, cs,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cs.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[1],
        num_q_heads, num_k_heads, cs.shape[-1] // 2, head_dim,
        BLOCK_HQ=pow2(num_q_heads), BLOCK_HK=pow2(num_k_heads), BLOCK_HALF=pow2(cs.shape[-1] // 2),
        BLOCK_D=pow2(head_dim), num_warps=4,
    )
    return q_out, k_out
