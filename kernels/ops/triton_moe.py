"""Fused mixture-of-experts MLP (same contract as kvrelay.kernels.moe_reference.fused_moe).

1. moe_align: the (token, k) pairs are sorted by expert and each expert's run is padded to a
   multiple of BLOCK_M, so every block of BLOCK_M rows belongs to one expert. Pure torch with no
   host read (no .item(), no data-dependent shapes): the grid is sized for the worst case
   (cdiv(T*k, BLOCK_M) + min(E, T*k) blocks) and blocks past the real ones carry expert -1 and
   return at once. That keeps the op capturable in a CUDA graph.
2. One grouped GEMM for gate_up: a program owns BLOCK_M sorted rows of one expert and BLOCK_N
   intermediate columns, accumulating the gate and the up columns together, and writes
   silu(gate) * up (the activation fused into the epilogue, so [rows, 2I] never exists).
3. One grouped GEMM for down, scaled by each row's routing weight in fp32 and stored to the
   row's (token, k) slot; the k slots of a token are summed in fp32 afterwards.
int8 weights (per expert, per output channel scales) are dequantised in the epilogue, as in
kvrelay.kernels.triton_int8. float8_e4m3fn weights make both GEMMs W8A8 as the dense fp8 linear
(kvrelay.kernels.triton_fp8): x is quantized per token before the gate_up GEMM and the activation
rows per row before the down GEMM, tl.dot multiplies the fp8 operands on the tensor cores (compute
capability 8.9+) into fp32, and the epilogue applies the row scale then the channel scale in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvrelay.kernels.moe_reference import check_moe_args
from kvrelay.kernels.triton_common import dot_in_fp32, on_device, pow2
from kvrelay.kernels.triton_fp8 import quantize_fp8


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_slots[num_blocks * block_m] int32, block_expert[num_blocks] int32).

    sorted_slots holds flat (token * k + j) slot ids grouped by expert, each group padded with the
    sentinel T*k to a multiple of block_m; block_expert[b] is the expert of rows [b*block_m,
    (b+1)*block_m), or -1 for blocks past the last group. Ids outside [0, num_experts) are dropped.
    """
    device = topk_ids.device
    n = topk_ids.numel()
    num_blocks = triton.cdiv(n, block_m) + min(num_experts, n)
    flat = topk_ids.reshape(-1).long()
    mine = (flat >= 0) & (flat < num_experts)
    bucket = torch.where(mine, flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    dump = num_blocks * block_m  # one spare slot takes the dropped ids' writes
    starts = torch.cat([ends - padded, torch.full((1,), dump, dtype=torch.int64, device=device)])  # no H2D copy
    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket.index_select(0, order)
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n, device=device) - first.index_select(0, sorted_bucket)
    dest = torch.where(sorted_bucket < num_experts, starts.index_select(0, sorted_bucket) + rank, dump)
    sorted_slots = torch.full((dump + 1,), n, dtype=torch.int32, device=device)
    sorted_slots.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(ends, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_slots[:dump], block_expert


@triton.jit(do_not_specialize=["num_slots"])  # the token count changes every step
def _gate_up_kernel(
    x_ptr, x_scale_ptr, w_ptr, scale_ptr, slots_ptr, block_expert_ptr, out_ptr,
    num_slots, inter, hidden, x_stride, w_stride_e, w_stride_n, out_stride,
    TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, DOT_FP32: tl.constexpr, FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(slots_ptr + rows)
    valid = slot < num_slots
    token = (slot // TOP_K).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < inter
    rk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + token[:, None] * x_stride
    w_gate = w_ptr + expert * w_stride_e + rn.to(tl.int64)[None, :] * w_stride_n
    w_up = w_gate + inter * w_stride_n
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + rk
        k_mask = k < hidden
        a = tl.load(x_rows + k[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w_mask = k_mask[:, None] & n_mask[None, :]
        wg = tl.load(w_gate + k[:, None], mask=w_mask, other=0)  # [K, N]
        wu = tl.load(w_up + k[:, None], mask=w_mask, other=0)
        if FP8:  # fp8 x fp8 on the tensor cores, fp32 accumulation; loaded as bytes (see fused_moe)
            a = a.to(tl.float8e4nv, bitcast=True)
            acc_gate = tl.dot(a, wg.to(tl.float8e4nv, bitcast=True), acc_gate)
            acc_up = tl.dot(a, wu.to(tl.float8e4nv, bitcast=True), acc_up)
        elif DOT_FP32:
            a = a.to(tl.float32)
            acc_gate = tl.dot(a, wg.to(tl.float32), acc_gate, input_precision="ieee")
            acc_up = tl.dot(a, wu.to(tl.float32), acc_up, input_precision="ieee")
        else:  # int8 weights are exact in fp16/bf16
            acc_gate = tl.dot(a, wg.to(a.dtype), acc_gate)
            acc_up = tl.dot(a, wu.to(a.dtype), acc_up)
    if FP8:  # the token's activation scale first, as reference.fp8_linear multiplies
        x_scale = tl.load(x_scale_ptr + token, mask=valid, other=0.0)[:, None]
        acc_gate = acc_gate * x_scale
        acc_up = acc_up * x_scale
    if HAS_SCALE:
        scales = scale_ptr + expert * 2 * inter + rn
        acc_gate = acc_gate * tl.load(scales, mask=n_mask, other=0.0)[None, :]
        acc_up = acc_up * tl.load(scales + inter, mask=n_mask, other=0.0)[None, :]
    # Round as the reference's eager MLP does: gate and up to the dtype, then silu(gate), then the product.
    dtype = out_ptr.dtype.element_ty
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    dst = out_ptr + rows.to(tl.int64)[:, None] * out_stride + rn[None, :]
    tl.store(dst, (act * up).to(dtype), mask=valid[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_slots"])
def _down_kernel(
    h_ptr, h_scale_ptr, w_ptr, scale_ptr, slots_ptr, block_expert_ptr, weights_ptr, out_ptr,
    num_slots, hidden, inter, h_stride, w_stride_e, w_stride_n, out_stride,
    HAS_SCALE: tl.constexpr, DOT_FP32: tl.constexpr, FP8: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OUT_DTYPE: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(slots_ptr + rows)
    valid = slot < num_slots
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < hidden
    rk = tl.arange(0, BLOCK_K)
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * h_stride
    w_cols = w_ptr + expert * w_stride_e + rn.to(tl.int64)[None, :] * w_stride_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + rk
        k_mask = k < inter
        a = tl.load(h_rows + k[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0)
        if FP8:
            acc = tl.dot(a.to(tl.float8e4nv, bitcast=True), w.to(tl.float8e4nv, bitcast=True), acc)
        elif DOT_FP32:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w.to(a.dtype), acc)
    if FP8:
        acc = acc * tl.load(h_scale_ptr + rows, mask=valid, other=0.0)[:, None]
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + expert * hidden + rn, mask=n_mask, other=0.0)[None, :]
    acc = acc.to(OUT_DTYPE).to(tl.float32)  # the expert's output in the dtype, as the reference
    weight = tl.load(weights_ptr + slot, mask=valid, other=0.0)
    dst = out_ptr + slot.to(tl.int64)[:, None] * out_stride + rn[None, :]
    tl.store(dst, acc * weight[:, None], mask=valid[:, None] & n_mask[None, :])


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def check_fp8_device(device: torch.device) -> None:
    """fp8 experts multiply fp8 operands on FP8 tensor cores: one clear error on GPUs without them."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"fp8 MoE experts need FP8 tensor cores (compute capability 8.9+: Ada, Hopper or "
                         f"newer), this GPU is {major}.{minor}; use --quantization int8")


def _tiles(rows_per_expert: float, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps). BLOCK_M follows the tokens an expert gets on average
    (decode: a few, so M tiles of 16 waste little padding); exact fp32 dots run on FMA units and
    need small tiles to stay within registers."""
    if dot_in_fp32(dtype):
        return (16, 32, 32, 4) if rows_per_expert <= 16 else (32, 64, 32, 4)
    if rows_per_expert <= 16:
        return 16, 64, 128, 4
    if rows_per_expert <= 64:
        return 64, 64, 64, 4
    return 64, 128, 64, 8


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    check_moe_args(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    num_tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    num_slots = num_tokens * top_k
    partial = torch.zeros((num_slots, hidden), dtype=torch.float32, device=x.device)
    if num_slots == 0 or hidden == 0:
        return partial.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
    x = x if x.stride(-1) == 1 else x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    fp8 = w13.dtype == torch.float8_e4m3fn
    if fp8:
        check_fp8_device(x.device)
    # fp8 dots run on tensor cores whatever x's dtype (fp32 included): the 16-bit tiles, K >= 32.
    bm, bn, bk, warps = _tiles(num_slots / num_experts, torch.bfloat16 if fp8 else x.dtype)
    min_k = 32 if fp8 else 16
    slots, block_expert = moe_align(on_device(topk_ids, x.device), num_experts, bm)
    num_blocks = block_expert.shape[0]
    # fp8: every row of h is quantized, so the pad rows (never stored by the kernel) must be finite.
    h = (torch.zeros if fp8 else torch.empty)((num_blocks * bm, inter), dtype=x.dtype, device=x.device)
    has_scale = w13_scale is not None
    s13 = on_device(w13_scale.float(), x.device) if has_scale else x
    s2 = on_device(w2_scale.float(), x.device) if has_scale else x
    dot32 = dot_in_fp32(x.dtype)
    a, a_scale = quantize_fp8(x) if fp8 else (x, x)  # per-token dynamic scales
    if fp8:  # fp8 operands travel as uint8 and are bitcast after a masked load with a zero fill
        a, w13, w2 = a.view(torch.uint8), w13.view(torch.uint8), w2.view(torch.uint8)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, bn))](
        a, a_scale, w13, s13, slots, block_expert, h,
        num_slots, inter, hidden, a.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        TOP_K=top_k, HAS_SCALE=has_scale, DOT_FP32=dot32, FP8=fp8,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=min(bk, pow2(hidden, min_k)), num_warps=warps,
    )
    weights = on_device(topk_weights.float(), x.device)
    hq, h_scale = h, h
    if fp8:  # per row of the sorted activations
        hq, h_scale = quantize_fp8(h)
        hq = hq.view(torch.uint8)
    _down_kernel[(num_blocks, triton.cdiv(hidden, bn))](
        hq, h_scale, w2, s2, slots, block_expert, weights, partial,
        num_slots, hidden, inter, hq.stride(0), w2.stride(0), w2.stride(1), partial.stride(0),
        HAS_SCALE=has_scale, DOT_FP32=dot32, FP8=fp8,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=min(bk, pow2(inter, min_k)), OUT_DTYPE=_TL_DTYPES[x.dtype],
        num_warps=warps,
    )
    return partial.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
