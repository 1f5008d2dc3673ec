"""int8 weight-only linear: per-output-channel symmetric quantisation and the matmul that dequantises
the weight tile on the fly (activations stay fp16/bf16/fp32, accumulation in fp32)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvrelay.kernels.triton_common import dot_in_fp32, on_device, pow2, rows_2d, sm_count


@triton.jit
def _round_half_even(v):
    # torch.round rounds halves to even; floor-based so it behaves the same on GPU and interpreter.
    f = tl.floor(v)
    diff = v - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return tl.where(diff > 0.5, f + 1.0, tl.where(diff < 0.5, f, tl.where(odd, f + 1.0, f)))


@triton.jit
def _quantize_kernel(w_ptr, q_ptr, scale_ptr, w_stride, q_stride, K, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + row * w_stride + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(w))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-8), 127.0)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + row * w_stride + cols, mask=cols < K, other=0.0).to(tl.float32)
        qv = _round_half_even(tl.math.div_rn(w, scale))
        qv = tl.minimum(tl.maximum(qv, -127.0), 127.0)
        tl.store(q_ptr + row * q_stride + cols, qv.to(tl.int8), mask=cols < K)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = rows_2d(weight)
    n, k = w.shape
    q = torch.empty((n, k), dtype=torch.int8, device=w.device)
    scale = torch.empty(n, dtype=torch.float32, device=w.device)
    if n > 0 and k > 0:
        _quantize_kernel[(n,)](w, q, scale, w.stride(0), q.stride(0), k, BLOCK_K=min(pow2(k), 1024))
    return q, scale


@triton.jit(do_not_specialize=["M"])  # the token count changes every step
def _int8_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr,
    M, N, K, x_stride, w_stride, out_stride, k_per_split,
    HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * x_stride
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * w_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_end, BLOCK_K):
        k = k0 + rk
        k_mask = k < k_end
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)  # [K, N] int8
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            # |w| <= 127 is exact in fp16/bf16, so the tensor-core dot sees the true weight.
            acc = tl.dot(x, w.to(x.dtype), acc)
    acc = acc * tl.load(scale_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:  # noqa: SIM102 - a constexpr test, then a runtime one: Triton prunes the first
        if split == 0:
            acc = acc + tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K > 1:  # fp32 partial sums [SPLIT_K, M, N], added up by the caller
        dst = out_ptr + (split * M + rm.to(tl.int64))[:, None] * N + rn[None, :]
        tl.store(dst, acc, mask=mask)
    else:
        dst = out_ptr + rm.to(tl.int64)[:, None] * out_stride + rn[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _matmul_config(m: int, dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by token count: decode-sized M is tiny.

    fp32 activations take an exact (non-tf32) dot, which runs on FMA units and needs small tiles to
    stay within registers (checked with ptxas for sm_90: no spills).
    """
    if dtype == torch.float32:
        return (16, 32, 32, 4, 2) if m <= 16 else (32, 64, 32, 4, 2)
    if m <= 16:
        return 16, 64, 128, 4, 4
    if m <= 64:
        return 64, 128, 64, 4, 3
    return 128, 128, 64, 8, 3


def int8_matmul(
    x: torch.Tensor, weight_int8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """Same contract as reference.int8_matmul; split_k overrides the K-split choice."""
    n, k = weight_int8.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} input features, the weight expects {k}")
    x2 = rows_2d(x)
    w = weight_int8 if weight_int8.stride(-1) == 1 else weight_int8.contiguous()
    m = x2.shape[0]
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, n)
    if m == 0 or n == 0:
        return out
    bm, bn, bk, warps, stages = _matmul_config(m, x.dtype)
    bk = min(bk, pow2(k, 16))
    grid_mn = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split_k = choose_split_k(grid_mn, k, bk, x.device) if split_k is None else split_k
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), bk) * bk
    target = out2 if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    _int8_matmul_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), split_k)](
        x2, w, on_device(scale, x.device), on_device(bias, x.device) if bias is not None else scale, target,
        m, n, k, x2.stride(0), w.stride(0), out2.stride(0), k_per_split,
        HAS_BIAS=bias is not None, DOT_FP32=dot_in_fp32(x.dtype), SPLIT_K=split_k,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
    )
    if split_k > 1:
        out2.copy_(target.sum(dim=0))
    return out


def choose_split_k(programs: int, k: int, block_k: int, device: torch.device) -> int:
    """Small-M products give too few (M, N) tiles to fill the GPU: split K until there are about two
    programs per SM, each keeping at least four K tiles."""
    split = 1
    while programs * split * 2 <= 2 * sm_count(device) and k // (2 * split * block_k) >= 4:
        split *= 2
    return split
