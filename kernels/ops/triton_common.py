"""Small helpers shared by the Triton kernel wrappers: launch sizing and interpreter detection."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# The window argument of the attention kernels when a layer has none: wider than any context.
NO_WINDOW = 1 << 30


@triton.jit
def softcap_log2(s, scale_log2, softcap):
    """Raw q.k scores -> softcap * tanh(s * scale / softcap), in the kernels' base-2 domain (times
    log2(e)); tanh(y) = 1 - 2 / (exp(2y) + 1), which saturates cleanly at both ends."""
    y = s * (scale_log2 * 0.6931471805599453) / softcap
    y = tl.minimum(tl.maximum(y, -15.0), 15.0)  # tanh is +-1 in fp32 past 9; keeps exp finite
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * y) + 1.0)) * 1.4426950408889634


def interpreting() -> bool:
    """True when kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def pow2(n: int, minimum: int = 1) -> int:
    """Next power of two >= max(n, minimum): tl.arange sizes must be powers of two."""
    return max(triton.next_power_of_2(max(int(n), 1)), minimum)


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether a kernel must upcast tl.dot operands to fp32.

    fp32 inputs always (computed with input_precision="ieee" so no tf32 rounding); bf16 also under
    the interpreter, whose tl.dot multiplies bf16 raw bits as integers.
    """
    return dtype == torch.float32 or interpreting()


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors on the tensor's device; a small fixed number on CPU."""
    if device.type != "cuda":
        return 4
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An index or side tensor moved next to the data and made contiguous (no-ops when it already is)."""
    return t.to(device).contiguous()


def rows_2d(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last_dim] with a unit stride on the last dim (a view when possible)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:  # rows not uniformly strided
        return x.reshape(-1, x.shape[-1])
