"""The elementwise, block-copy, int8 and MoE cases of benchmarks/kernels_gpu.py (--only elementwise,
blocks,int8,moe): RMSNorm, fused add+RMSNorm, SiLU-and-mul, rotary embedding and write_kv against the
eager reference ops, and rotary with write_kv in one launch against the two kernels; gather/scatter of
whole KV blocks; int8 weight quantization and the W8A16 matmul against bf16 F.linear; the fused MoE
kernel (bf16 and, on FP8 GPUs, fp8 experts) against a per-expert torch loop. Each case checks the
kernel against its reference before timing it through Bench."""

from __future__ import annotations

import math
from functools import partial
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kernels_gpu import Bench


def bench_elementwise(b: Bench, ops, ref, tokens, hidden, inter, heads, kv_heads, head_dim):
    torch = b.torch
    dev, dt = b.device, b.dtype
    es = torch.empty((), dtype=dt).element_size()
    x = torch.randn((tokens, hidden), device=dev).to(dt)
    res = torch.randn((tokens, hidden), device=dev).to(dt)
    w = torch.randn((hidden,), device=dev).to(dt)
    b.add(
        "rms_norm",
        f"T={tokens} hidden={hidden}",
        lambda: ops.rms_norm(x, w, 1e-5),
        lambda: ref.rms_norm(x, w, 1e-5),
        "eager",
        ref.rms_norm(x, w, 1e-5),
        ops.rms_norm(x, w, 1e-5),
        nbytes=2 * x.numel() * es,
    )
    b.add(
        "fused_add_rms_norm",
        f"T={tokens} hidden={hidden}",
        lambda: ops.fused_add_rms_norm(x, res, w, 1e-5),
        lambda: ref.fused_add_rms_norm(x, res, w, 1e-5),
        "eager",
        ref.fused_add_rms_norm(x, res, w, 1e-5),
        ops.fused_add_rms_norm(x, res, w, 1e-5),
        nbytes=4 * x.numel() * es,
    )

    g = torch.randn((tokens, 2 * inter), device=dev).to(dt)
    b.add(
        "silu_and_mul",
        f"T={tokens} inter={inter}",
        lambda: ops.silu_and_mul(g),
        lambda: ref.silu_and_mul(g),
        "eager",
        ref.silu_and_mul(g),
        ops.silu_and_mul(g),
        nbytes=3 * tokens * inter * es,
    )

    qkv = torch.randn((tokens, (heads + 2 * kv_heads) * head_dim), device=dev).to(dt)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 8192, (tokens,), device=dev)
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=dev).float() / head_dim))
    freqs = torch.outer(torch.arange(8192, device=dev).float(), inv)
    cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    b.add(
        "rotary_embedding",
        f"T={tokens} H={heads}/{kv_heads} D={head_dim}",
        lambda: ops.rotary_embedding(positions, q, k, cache),
        lambda: ref.rotary_embedding(positions, q, k, cache),
        "eager",
        ref.rotary_embedding(positions, q, k, cache),
        ops.rotary_embedding(positions, q, k, cache),
        nbytes=2 * (heads + kv_heads) * head_dim * tokens * es + tokens * head_dim * 4,
    )

    num_blocks = math.ceil(tokens / 16) + 8
    k_cache = torch.zeros((num_blocks, 16, kv_heads, head_dim), device=dev, dtype=dt)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * 16, device=dev)[:tokens]
    ops.write_kv(k, v, k_cache, v_cache, slots)
    ref.write_kv(k, v, k_ref, v_ref, slots)
    b.add(
        "write_kv",
        f"T={tokens} Hkv={kv_heads} D={head_dim}",
        lambda: ops.write_kv(k, v, k_cache, v_cache, slots),
        lambda: ref.write_kv(k, v, k_ref, v_ref, slots),
        "eager",
        (k_ref, v_ref),
        (k_cache, v_cache),
        nbytes=4 * tokens * kv_heads * head_dim * es,
        atol=0,
        rtol=0,
    )

    # The engine's layer_qkv: rotary then the K/V write in one launch, against the two kernels.
    k_two, v_two = k_cache.clone(), v_cache.clone()

    def two_ops():
        q_rot, k_rot = ops.rotary_embedding(positions, q, k, cache)
        ops.write_kv(k_rot, v, k_two, v_two, slots)
        return q_rot, k_rot

    want_q, want_k = two_ops()
    got_q, got_k = ops.rotary_and_write_kv(positions, q, k, v, cache, k_cache, v_cache, slots)
    b.add(
        "rotary_and_write_kv",
        f"T={tokens} H={heads}/{kv_heads} D={head_dim}",
        lambda: ops.rotary_and_write_kv(positions, q, k, v, cache, k_cache, v_cache, slots),
        two_ops,
        "rotary+write_kv",
        (want_q, want_k, k_two, v_two),
        (got_q, got_k, k_cache, v_cache),
        nbytes=(2 * (heads + kv_heads) * head_dim + 3 * kv_heads * head_dim) * tokens * es + tokens * head_dim * 4,
        atol=0,
        rtol=0,
    )


def bench_blocks(b: Bench, ops, ref, layers, num_blocks, moved, kv_heads, head_dim):
    torch = b.torch
    kv = torch.randn((layers, 2, num_blocks, 16, kv_heads, head_dim), device=b.device).to(b.dtype)
    ids = torch.randperm(num_blocks, device=b.device)[:moved].to(torch.int32)
    packed = ops.gather_blocks(kv, ids, 0, layers)
    nbytes = 2 * packed.numel() * packed.element_size()
    shape = f"L={layers} blocks={moved}/{num_blocks} Hkv={kv_heads} D={head_dim}"
    b.add(
        "gather_blocks",
        shape,
        lambda: ops.gather_blocks(kv, ids, 0, layers),
        lambda: ref.gather_blocks(kv, ids, 0, layers),
        "eager",
        ref.gather_blocks(kv, ids, 0, layers),
        packed,
        nbytes=nbytes,
        atol=0,
        rtol=0,
    )
    dst_ids = torch.randperm(num_blocks, device=b.device)[:moved]
    dst, dst_ref = kv.clone(), kv.clone()
    ops.scatter_blocks(dst, dst_ids, packed, 0, layers)
    ref.scatter_blocks(dst_ref, dst_ids, packed, 0, layers)
    b.add(
        "scatter_blocks",
        shape,
        lambda: ops.scatter_blocks(dst, dst_ids, packed, 0, layers),
        lambda: ref.scatter_blocks(dst_ref, dst_ids, packed, 0, layers),
        "eager",
        dst_ref,
        dst,
        nbytes=nbytes,
        atol=0,
        rtol=0,
    )

    # The CUDA IPC plane's checksum of a gathered chunk (both sides compute it per hand-off chunk):
    # the Triton pass against the torch version, bit for bit.
    from kvrelay.kernels.triton_checksum import block_checksum, checksum
    from kvrelay.kvtransfer.cuda_ipc import K1, K2, torch_checksum

    words = packed.reshape(-1).view(torch.int32)
    b.add(
        "kv_checksum",
        shape,
        lambda: checksum(words, K1, K2),
        lambda: torch_checksum(words),
        "torch int64",
        torch_checksum(words),
        checksum(words, K1, K2),
        nbytes=nbytes // 2,
        atol=0,
        rtol=0,
    )
    # Each side of a CUDA IPC chunk in one pass from the blocks: the prefill side's checksum (no
    # gather) and the decode side's copy into its reservation with the checksum of what it stored,
    # against the passes they replaced (gather + checksum; index_select, index_copy_, index_select
    # + checksum). nbytes: what the fused kernel must move (read; read + write).
    src_ids = ids  # the gathered blocks above
    landed = kv.clone()

    def three_passes():
        moved = kv[0:layers].index_select(2, src_ids)
        landed[0:layers].index_copy_(2, dst_ids, moved)
        return checksum(landed[0:layers].index_select(2, dst_ids).reshape(-1).view(torch.int32), K1, K2)

    b.add(
        "kv_block_checksum",
        shape,
        lambda: block_checksum(kv, src_ids, 0, layers, K1, K2),
        lambda: checksum(ops.gather_blocks(kv, src_ids, 0, layers).reshape(-1).view(torch.int32), K1, K2),
        "gather + checksum",
        torch_checksum(words),
        block_checksum(kv, src_ids, 0, layers, K1, K2),
        nbytes=nbytes // 2,
        atol=0,
        rtol=0,
    )
    b.add(
        "kv_copy_checksum",
        shape,
        lambda: block_checksum(kv, src_ids, 0, layers, K1, K2, dst=landed, dst_ids=dst_ids),
        three_passes,
        "3 passes + checksum",
        torch_checksum(words),
        block_checksum(kv, src_ids, 0, layers, K1, K2, dst=landed, dst_ids=dst_ids),
        nbytes=nbytes,
        atol=0,
        rtol=0,
    )


def bench_int8(b: Bench, ops, ref, shapes):
    torch = b.torch
    F = torch.nn.functional
    for m, n, k in shapes:
        weight = torch.randn((n, k), device=b.device).to(b.dtype) * 0.02
        wq, scale = ops.quantize_int8(weight)
        want_q, want_scale = ref.quantize_int8(weight)
        err = (wq.int() - want_q.int()).abs().max().item()
        b.add(
            "quantize_int8",
            f"N={n} K={k}",
            partial(ops.quantize_int8, weight),
            partial(ref.quantize_int8, weight),
            "eager",
            want_scale,
            scale,
            nbytes=weight.numel() * (weight.element_size() + 1),
            atol=0,
            rtol=0,
        )
        if err:
            b.rows[-1].ok = False
        x = torch.randn((m, k), device=b.device).to(b.dtype)
        got = ops.int8_matmul(x, wq, scale)
        want = ref.int8_matmul(x, wq, scale)
        nbytes = n * k + (m * k + m * n) * x.element_size()
        flops = 2 * m * n * k
        b.add(
            "int8_matmul",
            f"M={m} N={n} K={k}",
            partial(ops.int8_matmul, x, wq, scale),
            partial(F.linear, x, weight),
            "F.linear bf16",
            want,
            got,
            nbytes=nbytes if m <= 64 else None,
            flops=flops if m > 64 else None,
            atol=5e-2,
            rtol=2e-2,
        )


def bench_moe(b: Bench, ops, shapes):
    """The fused MoE kernel beside a per-expert torch loop (what a plain PyTorch MoE layer does), with
    bf16 and (FP8 GPUs) fp8 experts. Bytes: the experts the routing touched plus activations (the fp8
    row counts the activations at one byte too: a lower bound); FLOPs: 6 * tokens * top_k * H * I."""
    from kvrelay.kernels import reference as ref
    from kvrelay.kernels.moe_reference import fused_moe as moe_ref
    from kvrelay.kernels.moe_reference import fused_moe_per_expert_loop

    torch = b.torch
    for tokens, hidden, inter, experts, top_k in shapes:
        w13 = (torch.randn((experts, 2 * inter, hidden), device=b.device) * hidden**-0.5).to(b.dtype)
        w2 = (torch.randn((experts, hidden, inter), device=b.device) * inter**-0.5).to(b.dtype)
        x = torch.randn((tokens, hidden), device=b.device).to(b.dtype)
        weights, ids = torch.randn((tokens, experts), device=b.device).softmax(-1).topk(top_k, dim=-1)
        got = ops.fused_moe(x, w13, w2, weights, ids)
        want = moe_ref(x, w13, w2, weights, ids)
        hit = int(ids.unique().numel())
        nbytes = hit * 3 * inter * hidden * w13.element_size() + 2 * tokens * hidden * x.element_size()
        flops = 6 * tokens * top_k * hidden * inter
        b.add(
            "fused_moe",
            f"T={tokens} H={hidden} I={inter} E={experts} k={top_k}",
            partial(ops.fused_moe, x, w13, w2, weights, ids),
            partial(fused_moe_per_expert_loop, x, w13, w2, weights, ids),
            "expert loop",
            want,
            got,
            nbytes=nbytes if tokens <= 64 else None,
            flops=flops if tokens > 64 else None,
            atol=5e-2,
            rtol=5e-2,
        )
        if b.device.type == "cuda" and torch.cuda.get_device_capability(b.device) < (8, 9):
            continue  # fp8 experts need FP8 tensor cores
        # fp8 experts (W8A8, per expert per channel weight scales, per token activation scales) against
        # the same bf16 expert loop; checked against the fp8 reference.
        q13, s13 = ref.quantize_fp8(w13.reshape(-1, hidden))
        q2, s2 = ref.quantize_fp8(w2.reshape(-1, inter))
        q13, q2, s13, s2 = q13.view(w13.shape), q2.view(w2.shape), s13.view(experts, -1), s2.view(experts, -1)
        b.add(
            "fused_moe_fp8",
            f"T={tokens} H={hidden} I={inter} E={experts} k={top_k}",
            partial(ops.fused_moe, x, q13, q2, weights, ids, s13, s2),
            partial(fused_moe_per_expert_loop, x, w13, w2, weights, ids),
            "expert loop bf16",
            moe_ref(x, q13, q2, weights, ids, s13, s2),
            ops.fused_moe(x, q13, q2, weights, ids, s13, s2),
            nbytes=nbytes // w13.element_size() if tokens <= 64 else None,
            flops=flops if tokens > 64 else None,
            atol=5e-2,
            rtol=5e-2,
        )

