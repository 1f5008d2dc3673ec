"""Half-rotation rotary embedding (HF Llama layout) for q and k in one launch, one program per token.

Rope scaling variants (linear, dynamic NTK, llama3, yarn) only change the cos/sin table, which the
engine builds; the kernel reads cos_sin_cache[pos] = [cos(D/2) | sin(D/2)] whatever the variant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvrelay.kernels.triton_common import on_device, pow2


@triton.jit
def load_cos_sin(pos_ptr, cs_ptr, tok, cs_stride, half, out_ty: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """This token's (cos, sin) halves in fp32, and the column offsets d."""
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < half
    # The reference multiplies in q's dtype: round the table the same way.
    cos = tl.load(cs_ptr + pos * cs_stride + d, mask=dmask, other=0.0)
    sin = tl.load(cs_ptr + pos * cs_stride + half + d, mask=dmask, other=0.0)
    return cos.to(out_ty).to(tl.float32), sin.to(out_ty).to(tl.float32), d


@triton.jit
def rotate_heads(src_ptr, tok, tok_stride, head_stride, num_heads, half, cos, sin, d, BLOCK_H: tl.constexpr):
    """One token's heads rotated, in fp32: (first halves, second halves, mask), [BLOCK_H, BLOCK_HALF]."""
    h = tl.arange(0, BLOCK_H)
    mask = (h < num_heads)[:, None] & (d < half)[None, :]
    src = src_ptr + tok * tok_stride + h[:, None] * head_stride + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos[None, :] - x2 * sin[None, :], x2 * cos[None, :] + x1 * sin[None, :], mask


@triton.jit
def store_halves(dst_ptr, offsets, half, out1, out2, mask):
    tl.store(dst_ptr + offsets, out1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_ptr + offsets + half, out2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def head_offsets(tok, tok_stride, head_stride, d, BLOCK_H: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    return tok * tok_stride + h[:, None] * head_stride + d[None, :]


@triton.jit
def rotate_q_and_k(
    pos_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, cs_ptr, tok,
    q_tok_stride, q_head_stride, k_tok_stride, k_head_stride,
    qo_tok_stride, qo_head_stride, ko_tok_stride, ko_head_stride, cs_stride,
    num_q_heads, num_k_heads, half,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """Token tok's q and k rotated into q_out and k_out; returns k's rotated halves (fp32), their
    mask and the column offsets d, for a caller that stores k elsewhere too."""
    cos, sin, d = load_cos_sin(pos_ptr, cs_ptr, tok, cs_stride, half, q_out_ptr.dtype.element_ty, BLOCK_HALF)
    q1, q2, qmask = rotate_heads(q_ptr, tok, q_tok_stride, q_head_stride, num_q_heads, half, cos, sin, d, BLOCK_HQ)
    store_halves(q_out_ptr, head_offsets(tok, qo_tok_stride, qo_head_stride, d, BLOCK_HQ), half, q1, q2, qmask)
    k1, k2, kmask = rotate_heads(k_ptr, tok, k_tok_stride, k_head_stride, num_k_heads, half, cos, sin, d, BLOCK_HK)
    store_halves(k_out_ptr, head_offsets(tok, ko_tok_stride, ko_head_stride, d, BLOCK_HK), half, k1, k2, kmask)
    return k1, k2, kmask, d


@triton.jit
def _rotary_kernel(
    pos_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, cs_ptr,
    q_tok_stride, q_head_stride, k_tok_stride, k_head_stride,
    qo_tok_stride, qo_head_stride, ko_tok_stride, ko_head_stride, cs_stride,
    num_q_heads, num_k_heads, half,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    rotate_q_and_k(pos_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, cs_ptr, tl.program_id(0).to(tl.int64),
                   q_tok_stride, q_head_stride, k_tok_stride, k_head_stride,
                   qo_tok_stride, qo_head_stride, ko_tok_stride, ko_head_stride, cs_stride,
                   num_q_heads, num_k_heads, half, BLOCK_HQ, BLOCK_HK, BLOCK_HALF)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    cs = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    positions = on_device(positions, q.device)
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    half = cs.shape[-1] // 2
    if cs.shape[-1] != head_dim:
        raise ValueError(f"cos_sin_cache has {cs.shape[-1]} columns, expected head_dim {head_dim}")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if num_tokens > 0:
        _rotary_kernel[(num_tokens,)](
            positions, q, k, q_out, k_out, cs,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cs.stride(0),
            num_q_heads, num_k_heads, half,
            BLOCK_HQ=pow2(num_q_heads), BLOCK_HK=pow2(num_k_heads), BLOCK_HALF=pow2(half),
            num_warps=4,
        )
    return q_out, k_out
