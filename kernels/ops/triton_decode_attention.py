"""Paged decode attention: one new query token per sequence against its whole paged context.

One program handles one (sequence, KV head, split) and all the query heads that share that KV head
(grouped-query attention), so each K/V tile is read once per group. Softmax is online (running max
and sum, base 2). With more than one split, each split writes a normalised partial output and its
log-sum-exp, and a second small kernel combines them (split-KV, for long contexts and small batches).

Head dims below 16 cannot use tl.dot on a GPU; they take a broadcast-multiply-and-sum path.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from kvrelay.kernels.triton_common import dot_in_fp32, interpreting, on_device, pow2, sm_count

# A split covers at least this many tokens of the longest context the table allows: shorter
# splits cost more in the reduction than they save.
MIN_TOKENS_PER_SPLIT = 128
MAX_SPLITS = 32
# Software-pipelining depth on the GPU. With the block-table indirection, 3 keeps one K/V tile in
# flight per program (39 KB shared, ~4 programs per SM); 5 double-buffers it (72 KB, 3 per SM).
DECODE_STAGES = 3


# Values that change with the batch are not specialised on (1 / multiple of 16): no recompiles mid-run.
@triton.jit(do_not_specialize=["bt_stride", "num_splits", "max_context"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    q_b_stride, q_h_stride, o_b_stride, o_h_stride,
    cache_block_stride, cache_slot_stride, cache_head_stride, bt_stride,
    scale_log2, group, num_heads, num_splits, max_context,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, SPLIT: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Never walk past the block table, whatever seq_lens says.
    seq_len = tl.minimum(tl.load(seq_lens_ptr + b), max_context)
    # Each sequence's own length is split evenly (in whole tiles), so a CUDA graph captured for
    # the longest context still balances short ones, and no split of a short sequence idles.
    tokens_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < group
    d_mask = d < HEAD_DIM
    heads = kv_head * group + g
    q = tl.load(q_ptr + b.to(tl.int64) * q_b_stride + heads[:, None] * q_h_stride + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32 or not USE_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = bt_ptr + b.to(tl.int64) * bt_stride
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        page = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = page * cache_block_stride + (n % BLOCK_SIZE) * cache_slot_stride + kv_head * cache_head_stride
        kv_offs = row[:, None] + d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)  # issued early: both tiles in flight
        if USE_DOT:
            if DOT_FP32:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k.to(q.dtype)))
        else:
            s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        s = tl.where(n_mask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if USE_DOT:
            if DOT_FP32:
                # Round p as the GPU's 16-bit dot would, then multiply in fp32.
                p16 = p.to(v_cache_ptr.dtype.element_ty).to(tl.float32)
                acc = tl.dot(p16, v.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(p.to(v.dtype), v, acc)
        else:
            acc += tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
        m_i = m_new

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    store_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        # part_o[B, Hq, S, D] fp32 and part_lse[B, Hq, S] (log2 domain; -inf for an empty split).
        row_id = (b * num_heads + heads).to(tl.int64) * num_splits + split
        tl.store(part_o_ptr + row_id[:, None] * HEAD_DIM + d[None, :], out, mask=store_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row_id, lse, mask=g_mask)
    else:
        dst = out_ptr + b.to(tl.int64) * o_b_stride + heads[:, None] * o_h_stride + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, o_b_stride, o_h_stride, num_heads, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    row_id = (b * num_heads + h).to(tl.int64) * num_splits + s
    lse = tl.load(part_lse_ptr + row_id, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    o = tl.load(part_o_ptr + row_id[:, None] * HEAD_DIM + d[None, :],
                mask=s_mask[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(o * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    dst = out_ptr + b.to(tl.int64) * o_b_stride + h * o_h_stride + d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """About four programs per SM, in a power of two of splits, never splits shorter than
    MIN_TOKENS_PER_SPLIT. On an H200 (132 SMs, 8 KV heads, 4k context) this picks the fastest count
    measured at batch 4, 32 and 64 and within 2% of it at batch 1 (docs/benchmarks.md)."""
    programs = batch * num_kv_heads
    wanted = math.ceil(4 * sm_count(device) / max(programs, 1))
    wanted = 1 << (wanted.bit_length() - 1)  # 3 splits measured slower than 2 or 4 at batch 32
    return max(1, min(wanted, max_context // MIN_TOKENS_PER_SPLIT, MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Same contract as reference.paged_decode_attention; num_splits overrides the split-KV choice."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q heads/dim {num_heads}/{head_dim} do not fit cache heads/dim "
                         f"{num_kv_heads}/{cache_head_dim}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("K and V caches must share strides with a unit stride on head_dim")
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_tables, seq_lens = on_device(block_tables, q.device), on_device(seq_lens, q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    group = num_heads // num_kv_heads
    # The table width bounds every context, so splits are chosen without reading seq_lens on the host.
    max_context = block_tables.shape[1] * block_size
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, max_context, q.device)
    use_dot = head_dim >= 16
    block_d = pow2(head_dim)
    block_n = 64 if head_dim <= 128 else 32
    if not use_dot:
        block_n = 32
    split = num_splits > 1
    if split:
        part_o = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_lse,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        scale * math.log2(math.e), group, num_heads, num_splits, max_context,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        BLOCK_G=pow2(group, 16 if use_dot else 1), BLOCK_N=block_n, BLOCK_D=block_d,
        USE_DOT=use_dot, DOT_FP32=use_dot and dot_in_fp32(q.dtype), SPLIT=split,
        num_warps=4, num_stages=1 if interpreting() else DECODE_STAGES,
    )
    if split:
        _combine_splits_kernel[(batch, num_heads)](
            part_o, part_lse, out, out.stride(0), out.stride(1), num_heads, num_splits,
            HEAD_DIM=head_dim, BLOCK_S=pow2(num_splits), BLOCK_D=block_d, num_warps=1,
        )
    return out
