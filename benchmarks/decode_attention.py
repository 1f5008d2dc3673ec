"""CPU paged decode attention: the native kernel against the torch reference, over a KV pool too
big for the caches (one block table per layer, as in a decode step of an 8-layer model).

    .venv/bin/python benchmarks/decode_attention.py [--threads 2] [--batch 40]

Sequences of 300-700 tokens in 16-token blocks scattered over the pool, 8 heads of 64, fp32.
Prints milliseconds per step (all layers), the K/V bytes read per second, and the same call with
every block table pointing at 4 blocks that stay in cache: its time is the kernel's arithmetic,
and the difference is what memory adds.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from kvrelay.kernels import cpu_native, native_ops, reference

LAYERS, HEADS, HEAD_DIM, BLOCK = 8, 8, 64, 16


def step_time(fn, q, k_cache, v_cache, tables, lens, reps: int = 9) -> float:
    """Median seconds for one call per layer's block table."""
    for _ in range(2):
        for t in tables:
            fn(q, k_cache, v_cache, t, lens, HEAD_DIM**-0.5)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for t in tables:
            fn(q, k_cache, v_cache, t, lens, HEAD_DIM**-0.5)
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--batch", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if (reason := cpu_native.unavailable_reason()) is not None:
        raise SystemExit(f"native kernels unavailable: {reason}")
    rng = random.Random(0)
    torch.manual_seed(0)
    lens = [rng.randint(300, 700) for _ in range(args.batch)]
    per_seq = [(n + BLOCK - 1) // BLOCK for n in lens]
    num_blocks = LAYERS * sum(per_seq) + 4
    k_cache = torch.randn(num_blocks, BLOCK, HEADS, HEAD_DIM)
    v_cache = torch.randn(num_blocks, BLOCK, HEADS, HEAD_DIM)
    order = iter((torch.randperm(num_blocks - 4) + 4).tolist())
    width = max(per_seq)
    tables = []
    for _ in range(LAYERS):
        t = torch.zeros(args.batch, width, dtype=torch.int32)
        for b, n in enumerate(per_seq):
            t[b, :n] = torch.tensor([next(order) for _ in range(n)], dtype=torch.int32)
        tables.append(t)
    cached = [torch.arange(width, dtype=torch.int32).remainder(4).expand(args.batch, width).contiguous()] * LAYERS
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(args.batch, HEADS, HEAD_DIM)
    kv_bytes = LAYERS * sum(lens) * HEADS * HEAD_DIM * 4 * 2
    print(f"{args.batch} sequences, {LAYERS} layers, {kv_bytes / 1e6:.0f} MB of K/V per step, {args.threads} threads")
    native = step_time(native_ops.paged_decode_attention, q, k_cache, v_cache, tables, seq_lens)
    ref = step_time(reference.paged_decode_attention, q, k_cache, v_cache, tables, seq_lens)
    arith = step_time(native_ops.paged_decode_attention, q, k_cache, v_cache, cached, seq_lens)
    for name, s in (("torch reference", ref), ("native", native)):
        print(f"  {name:<16} {s * 1e3:7.2f} ms per step  {kv_bytes / s / 1e9:5.1f} GB/s")
    print(f"  native / reference speed: {ref / native:.2f}x")
    print(f"  native, blocks in cache: {arith * 1e3:.2f} ms per step (arithmetic; memory adds {(native - arith) * 1e3:.2f})")


if __name__ == "__main__":
    main()
