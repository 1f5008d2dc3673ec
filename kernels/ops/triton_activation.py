"""Gated MLP activations: x[T, 2I] = [gate | up] -> act(gate) * up, with act SiLU (Llama) or
tanh-approximated GELU (GeGLU, Gemma)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from kvrelay.kernels.triton_common import pow2, rows_2d


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, inter, BLOCK: tl.constexpr, GELU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        # 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), with tanh(y) = 1 - 2 / (exp(2y) + 1)
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        inner = tl.minimum(tl.maximum(inner, -15.0), 15.0)  # tanh is +-1 in fp32 past 9; keeps exp finite
        act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    # Round the activation to the storage dtype before the product, as eager torch does.
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    inter = x.shape[-1] // 2
    x2 = rows_2d(x)
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, inter)
    block = min(pow2(inter), 1024)
    if x2.shape[0] > 0 and inter > 0:
        grid = (x2.shape[0], triton.cdiv(inter, block))
        _act_and_mul_kernel[grid](x2, out2, x2.stride(0), out2.stride(0), inter, BLOCK=block, GELU=gelu,
                                  num_warps=min(max(block // 256, 1), 8))
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _act_and_mul(x, gelu=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _act_and_mul(x, gelu=True)
