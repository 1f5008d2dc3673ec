"""Mixture-of-experts MLP, the plain torch reference of the fused MoE kernel (kvrelay.kernels.triton_moe).

fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale=None, w2_scale=None) -> [T, H] in x's dtype:

    out[t] = sum_k topk_weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = topk_ids[t, k]

- x[T, H]; w13[E, 2I, H]: each expert's gate rows then up rows; w2[E, H, I] (the down projection).
- topk_weights[T, k] fp32 (the router's, already normalised as the model wants); topk_ids[T, k]
  integers. An id outside [0, E) contributes nothing: under expert parallelism a rank holds
  experts [start, start + E) and gets ids shifted by start, so other ranks' experts fall outside.
- int8 weights carry per-output-channel fp32 scales w13_scale[E, 2I] and w2_scale[E, H] (the scheme
  of kvrelay.kernels.reference.quantize_int8, per expert).
- float8_e4m3fn weights carry the same per-output-channel scales (quantize_fp8, per expert) and make
  each expert projection W8A8 exactly as the dense reference.fp8_linear: the expert's input rows are
  quantized to fp8 per token (dynamic scales), then the fp32-accumulated product is scaled.
- Each expert's projections run in x's dtype (rounded as an eager torch MLP rounds), the routing
  weight is applied in fp32 and the k contributions are summed in fp32, then cast to x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _expert_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    if scale is None:
        return F.linear(x, w)
    if w.dtype == torch.float8_e4m3fn:
        # Imported here: kvrelay.kernels.reference imports this module to re-export fused_moe.
        from kvrelay.kernels.reference import fp8_linear

        return fp8_linear(x, w, scale)
    return (torch.matmul(x.float(), w.float().t()) * scale.float()).to(x.dtype)


def check_moe_args(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale) -> None:
    """Shape checks shared by the reference and the kernel: one clear error per mismatch."""
    e, two_i, h = w13.shape
    if x.dim() != 2 or x.shape[1] != h:
        raise ValueError(f"x must be [tokens, {h}] for w13 {list(w13.shape)}, got {list(x.shape)}")
    if two_i % 2 or tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(
            f"w2 must be [{e}, {h}, {two_i // 2}] for w13 {list(w13.shape)}, got {list(w2.shape)}"
        )
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(
            f"topk_ids {list(topk_ids.shape)} and topk_weights {list(topk_weights.shape)} must both be "
            f"[{x.shape[0]}, top_k]"
        )
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("quantized (int8/fp8) experts need both w13_scale and w2_scale")
    if w2.dtype != w13.dtype:
        raise ValueError(f"w13 and w2 must share a dtype, got {w13.dtype} and {w2.dtype}")
    if w13.dtype in (torch.int8, torch.float8_e4m3fn) and w13_scale is None:
        raise ValueError(f"{w13.dtype} experts need per-output-channel w13_scale and w2_scale")
    if w13_scale is not None and (tuple(w13_scale.shape) != (e, two_i) or tuple(w2_scale.shape) != (e, h)):
        raise ValueError(
            f"scales must be [{e}, {two_i}] and [{e}, {h}], got "
            f"{list(w13_scale.shape)} and {list(w2_scale.shape)}"
        )


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
    num_experts = w13.shape[0]
    top_k = topk_ids.shape[1]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    flat = topk_ids.reshape(-1).long()
    mine = (flat >= 0) & (flat < num_experts)
    bucket = torch.where(mine, flat, num_experts)
    order = torch.argsort(bucket, stable=True)
    counts = torch.bincount(bucket, minlength=num_experts + 1).tolist()
    weights = topk_weights.reshape(-1).float()
    start = 0
    for e in range(num_experts):  # one loop iteration per expert that got tokens
        n = counts[e]
        if n == 0:
            continue
        slots = order[start : start + n]
        start += n
        tokens = slots // top_k
        s13 = w13_scale[e] if w13_scale is not None else None
        h = _expert_linear(x.index_select(0, tokens), w13[e], s13)
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
        h = _expert_linear(h, w2[e], w2_scale[e] if w2_scale is not None else None)
        # A token picks an expert at most once, so these rows are distinct: a plain indexed add
        # (torch's CPU index_add_ goes through a scatter that costs ~30 ms even for one row).
        out[tokens] += h.float() * weights[slots, None]
    return out.to(x.dtype)


def fused_moe_per_expert_loop(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The baseline benchmarks compare the kernel with: every expert in turn over a boolean mask of
    its tokens (what a plain PyTorch MoE layer does), no sorting."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        hit = topk_ids == e  # [T, k]
        rows = hit.any(dim=1)
        gate, up = F.linear(x[rows], w13[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[e]).float()
        out[rows] += y * (topk_weights * hit).sum(dim=1)[rows, None].float()
    return out.to(x.dtype)
