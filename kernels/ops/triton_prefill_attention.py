"""Prefill / extend attention over the paged cache, all sequences packed in one launch.

Each sequence's new tokens (a chunk) attend causally to its cached prefix plus themselves. Query
rows are cut into BLOCK_M tiles that never straddle two sequences: sequence b owns the tile ids
[qsl[b] // BLOCK_M + b, qsl[b+1] // BLOCK_M + b + 1), so the grid size T // BLOCK_M + B needs no
host read of the lengths, and a program finds its sequence by binary search over query_start_loc.
Keys are streamed BLOCK_N at a time through the block table (flash-style, online softmax): first
the tiles every query row may see in full, then the few diagonal tiles under the causal mask.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from kvrelay.kernels.triton_common import NO_WINDOW, dot_in_fp32, interpreting, on_device, pow2, softcap_log2


@triton.jit
def _attend_tile(
    q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table, kv_head, n0, kv_end, q_pos, d,
    cache_block_stride, cache_slot_stride, cache_head_stride, scale_log2, window, softcap,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr,
):
    n = n0 + tl.arange(0, BLOCK_N)
    n_mask = n < kv_end
    page = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    row = page * cache_block_stride + (n % BLOCK_SIZE) * cache_slot_stride + kv_head * cache_head_stride
    kv_offs = row[:, None] + d[None, :]
    kv_mask = n_mask[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0)
    if USE_DOT:
        if DOT_FP32:
            s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
    else:
        s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
    if SOFTCAP:
        s = softcap_log2(s, scale_log2, softcap)
    else:
        s = s * scale_log2
    if CAUSAL:  # masked tiles: the causal diagonal, and the far edge of a sliding window
        visible = (n[None, :] <= q_pos[:, None]) & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible & n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if CAUSAL:
        # A row may see no key of a diagonal tile yet; keep exp2 away from (-inf) - (-inf).
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    if USE_DOT:
        if DOT_FP32:
            p16 = p.to(v_cache_ptr.dtype.element_ty).to(tl.float32)
            acc = tl.dot(p16, v.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v, acc)
    else:
        acc += tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)
    return acc, m_new, l_i


# Values that change with the batch are not specialised on (1 / multiple of 16): no recompiles mid-run.
@triton.jit(do_not_specialize=["num_seqs", "bt_stride", "max_context", "window"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, out_ptr,
    q_tok_stride, q_head_stride, o_tok_stride, o_head_stride,
    cache_block_stride, cache_slot_stride, cache_head_stride, bt_stride,
    scale_log2, num_seqs, group, max_context, window, softcap,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, SOFTCAP: tl.constexpr,
):
    # Last tiles first: under the causal mask they carry the most keys, so the grid ends on light work.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // group
    # The sequence is the last b whose first tile id qsl[b] // BLOCK_M + b is <= tile.
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_M + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    m0 = (tile - (q_start // BLOCK_M + seq)) * BLOCK_M
    context = tl.load(seq_lens_ptr + seq)
    table_end = tl.minimum(context, max_context)  # never walk past the block table
    prefix = context - q_len

    rows = m0 + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    d = tl.arange(0, BLOCK_D)
    q_offs = (q_start + rows).to(tl.int64)[:, None] * q_tok_stride + head * q_head_stride + d[None, :]
    io_mask = row_mask[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + q_offs, mask=io_mask, other=0.0)
    if DOT_FP32 or not USE_DOT:
        q = q.to(tl.float32)
    q_pos = prefix + rows

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = bt_ptr + seq.to(tl.int64) * bt_stride
    # Keys [0, prefix + m0] are visible to every row of the tile; a tile past the chunk sees nothing.
    has_rows = m0 < q_len
    full_end = tl.where(has_rows, ((prefix + m0 + 1) // BLOCK_N) * BLOCK_N, 0)
    kv_end = tl.where(has_rows, tl.minimum(table_end, prefix + m0 + BLOCK_M), 0)
    full_end = tl.minimum(full_end, (kv_end // BLOCK_N) * BLOCK_N)
    # A sliding window hides keys at or before q_pos - window: tiles before the first row's window
    # are skipped (never read), and those the last row cannot see in full are masked.
    lo = tl.maximum(prefix + m0 - window + 1, 0)
    lo = tl.minimum((lo // BLOCK_N) * BLOCK_N, full_end)
    band = tl.maximum(prefix + m0 + BLOCK_M - window, 0)  # every row sees keys from here on
    band = tl.minimum(tl.maximum(((band + BLOCK_N - 1) // BLOCK_N) * BLOCK_N, lo), full_end)
    for n0 in range(lo, band, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table, kv_head, n0, kv_end, q_pos, d,
            cache_block_stride, cache_slot_stride, cache_head_stride, scale_log2, window, softcap,
            BLOCK_SIZE, HEAD_DIM, BLOCK_N, USE_DOT, DOT_FP32, True, SOFTCAP,
        )
    for n0 in range(band, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table, kv_head, n0, kv_end, q_pos, d,
            cache_block_stride, cache_slot_stride, cache_head_stride, scale_log2, window, softcap,
            BLOCK_SIZE, HEAD_DIM, BLOCK_N, USE_DOT, DOT_FP32, False, SOFTCAP,
        )
    for n0 in range(full_end, kv_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, table, kv_head, n0, kv_end, q_pos, d,
            cache_block_stride, cache_slot_stride, cache_head_stride, scale_log2, window, softcap,
            BLOCK_SIZE, HEAD_DIM, BLOCK_N, USE_DOT, DOT_FP32, True, SOFTCAP,
        )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offs = (q_start + rows).to(tl.int64)[:, None] * o_tok_stride + head * o_head_stride + d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def _tile_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) by head dim and dtype; no autotuning."""
    if head_dim < 16:
        return 16, 16, 4, 1
    if interpreting():
        return 32, 32, 4, 1
    if dtype == torch.float32:
        return 32, 64, 8, 2  # exact fp32 dot on FMA units: small tiles, no register spills on sm_90
    if head_dim > 128:
        return 64, 32, 4, 2
    if head_dim <= 64:
        return 128, 64, 4, 3
    return 128, 64, 8, 3


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Same contract as reference.paged_prefill_attention; block_m/block_n override the tiling."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q heads/dim {num_heads}/{head_dim} do not fit cache heads/dim "
                         f"{num_kv_heads}/{cache_head_dim}")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("K and V caches must share strides with a unit stride on head_dim")
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_tables = on_device(block_tables, q.device)
    query_start_loc, seq_lens = on_device(query_start_loc, q.device), on_device(seq_lens, q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_seqs = query_start_loc.numel() - 1
    if num_tokens == 0 or num_seqs <= 0:
        return out
    bm, bn, warps, stages = _tile_config(head_dim, q.dtype)
    bm, bn = block_m or bm, block_n or bn
    use_dot = head_dim >= 16
    grid = (num_tokens // bm + num_seqs, num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        scale * math.log2(math.e), num_seqs, num_heads // num_kv_heads, block_tables.shape[1] * block_size,
        window or NO_WINDOW, softcap or 1.0,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=pow2(head_dim),
        USE_DOT=use_dot, DOT_FP32=use_dot and dot_in_fp32(q.dtype), SOFTCAP=softcap is not None,
        num_warps=warps, num_stages=stages,
    )
    return out
