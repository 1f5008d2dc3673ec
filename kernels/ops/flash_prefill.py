"""Prefill attention through FlashAttention (torch.nn.attention.varlen), for chunks with no prefix.

When every prefill chunk of a step starts at position 0 (fresh prompts, the common case outside
chunked prefill and prefix hits), a chunk attends only to its own keys, which the step has just
computed as one packed [T, Hkv, D] tensor. FlashAttention's varlen kernel then does the work on
those contiguous keys: on an H200 our paged Triton kernel reached 0.54x torch SDPA at 4k and 8k
tokens (head_dim 128), and SDPA on CUDA runs the same FlashAttention. Chunks with a cached prefix
still go through the paged kernel (FlashAttention 2's paged mode wants pages of 256 tokens).

`fresh_prefill_attention` returns None where FlashAttention cannot serve the inputs (not CUDA, fp32,
soft-capping, head_dim over 256, or a torch whose varlen_attn lacks what the layer needs); the
caller then runs the paged kernel. The varlen API grew across torch releases (scale, window_size,
enable_gqa came after is_causal), so the call is shaped from its signature once.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _varlen() -> tuple[object, frozenset[str]] | None:
    """(varlen_attn, its keyword names), or None when this torch has no varlen attention."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


@functools.cache
def available() -> bool:
    """CUDA, a torch with varlen attention, and a small call that runs and matches SDPA: a build
    whose FlashAttention cannot run here (an older GPU, a CPU-only wheel's stubs) is found at start,
    logged, and left to the paged kernel."""
    if not torch.cuda.is_available() or _varlen() is None:
        return False
    try:
        gen = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(24, h, 64, generator=gen).to("cuda", torch.bfloat16) for h in (4, 2, 2))
        qsl = torch.tensor([0, 7, 24], dtype=torch.int32, device="cuda")
        got = fresh_prefill_attention(q, k, v, qsl, 17, 0.125)
        want = torch.cat([
            F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True,
                                           scale=0.125, enable_gqa=True).transpose(0, 1)
            for a, b in ((0, 7), (7, 24))
        ])
        if got is None or not torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2):
            raise RuntimeError("its output differs from torch SDPA on a probe")
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use it
        log.warning("FlashAttention varlen prefill unavailable, using the paged Triton kernel: %s", exc)
        return False
    return True


def fresh_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor | None:
    """Causal attention of each packed chunk over itself: q [T, H, D], k/v [T, Hkv, D], chunk b is
    rows query_start_loc[b]:query_start_loc[b + 1] (int32, on q's device), the longest
    max_query_len rows. window: a key at n is seen from q_pos only if q_pos - n < window (the paged
    kernels' rule). Returns [T, H, D], or None where FlashAttention cannot serve the inputs."""
    found = _varlen()
    head_dim = q.shape[-1]
    if (found is None or q.device.type != "cuda" or q.dtype not in _DTYPES or softcap is not None
            or head_dim > 256 or head_dim % 8):
        return None
    varlen_attn, names = found
    kwargs: dict = {}
    if "scale" in names:
        kwargs["scale"] = scale
    elif abs(scale - head_dim**-0.5) > 1e-6 * scale:
        return None
    if "window_size" in names:  # (left, right): keys q_pos - left .. q_pos + right are seen
        kwargs["window_size"] = (-1, 0) if window is None else (window - 1, 0)
    elif window is None and "is_causal" in names:
        kwargs["is_causal"] = True
    else:
        return None
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in names:
            kwargs["enable_gqa"] = True
        else:  # older torch: one K/V head per query head
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    qsl = query_start_loc.to(torch.int32)
    return varlen_attn(q, k, v, qsl, qsl, max_query_len, max_query_len, **kwargs)
