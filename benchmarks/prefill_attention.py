"""CPU prefill attention: the torch reference (query tiles, two matmuls, softmax) against SDPA with
a causal mask over the gathered context, the reference's former implementation.

    .venv/bin/python benchmarks/prefill_attention.py [--threads 2]

Shapes are (new tokens, context, query heads, KV heads), head dim 64: a fresh prompt, a chunk
continuing a long prompt, and GQA. Prints milliseconds per call, the ratio and the largest
difference between the two.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from kvrelay.kernels.reference import _causal_attention

SHAPES = [(64, 300, 8, 8), (272, 272, 8, 8), (512, 4096, 12, 4), (2048, 2048, 12, 4), (4096, 4096, 12, 4)]


def sdpa_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    lq, ctx, group = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - lq, ctx)[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


def seconds_per_call(fn, *args, reps: int) -> tuple[float, torch.Tensor]:
    out = fn(*args)  # warm-up
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    return (time.perf_counter() - start) / reps, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'new':>5} {'ctx':>5} {'Hq':>3} {'Hkv':>3}  {'SDPA+mask':>10} {'reference':>10}  ratio  max diff")
    for lq, ctx, hq, hkv in SHAPES:
        gen = torch.Generator().manual_seed(lq + ctx)
        q = torch.randn(lq, hq, 64, generator=gen)
        k, v = torch.randn(ctx, hkv, 64, generator=gen), torch.randn(ctx, hkv, 64, generator=gen)
        reps = 3 if lq * ctx >= 2048 * 2048 else 20
        base, want = seconds_per_call(sdpa_masked, q, k, v, 0.125, reps=reps)
        ours, got = seconds_per_call(_causal_attention, q, k, v, 0.125, reps=reps)
        print(f"{lq:5d} {ctx:5d} {hq:3d} {hkv:3d}  {base * 1e3:8.1f}ms {ours * 1e3:8.1f}ms  {base / ours:4.1f}x"
              f"  {(want - got).abs().max().item():.1e}")


if __name__ == "__main__":
    main()
