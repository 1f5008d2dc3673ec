"""RMSNorm and RMSNorm fused with the residual add: one program per row, fp32 statistics."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvrelay.kernels.triton_common import pow2, rows_2d


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
    x_stride, res_stride, out_stride, sum_stride,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to its storage dtype first: the reference normalises the stored sum.
        summed = (x + r).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * sum_stride + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    rstd = 1.0 / tl.sqrt(var + eps)
    # Like HF Llama: normalise in fp32, round to the input dtype, then scale by the weight.
    if HAS_RESIDUAL:
        normed = (x * rstd).to(sum_ptr.dtype.element_ty).to(tl.float32)
    else:
        normed = (x * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    hidden = x.shape[-1]
    x2 = rows_2d(x)
    sum_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, sum_dtype), device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        r2 = rows_2d(residual)
        summed = torch.empty(x.shape, dtype=sum_dtype, device=x.device)
        s2 = summed.view(-1, hidden)
    else:
        r2 = s2 = x2  # unused
        summed = None
    block = pow2(hidden)
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight.contiguous(), out2, s2,
            x2.stride(0), r2.stride(0), out2.stride(0), s2.stride(0),
            hidden, float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 16),
        )
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out, summed = _launch(x, residual, weight, eps)
    return out, summed
