"""The `kernels` section of benchmarks/gpu_engine.py: the Triton kernels through kernels_gpu.py's
Bench (decode attention with a split-count sweep at small batch, prefill attention against SDPA, int8
W8A16 against bf16 F.linear), then on a GPU the kernels alone under torch.profiler with the L2 flushed
before each call (decode attention per split count against SDPA on contiguous K/V; int8 W8A16 and fp8
W8A8 linears against bf16), and the fp8 GEMM (torch._scaled_mm, rowwise scales) at M=N=K=4096. Also
profiled_kernel_ms, the profiler's CUDA kernel time per call that the `step` section reads too."""

from __future__ import annotations


def profiled_kernel_ms(prof, calls: int) -> float:
    """Device time of the CUDA kernels torch.profiler saw, per call (ms); zero-fill kernels (the L2
    flush of kernel_only_ms) not counted."""
    import torch

    total_us = 0.0
    for e in prof.events():
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and "Fill" not in e.name:
            total_us += getattr(e, "device_time", 0.0) or getattr(e, "cuda_time", 0.0)
    return total_us / 1e3 / calls



def section_kernels(rep, smoke: bool) -> None:
    import torch
    import torch.nn.functional as F
    from kernels_gpu import Bench, bench_decode, bench_int8, bench_prefill
    from kvrelay.kernels import reference as ref
    from kvrelay.kernels import triton_decode_attention as tda
    from kvrelay.kernels.registry import get_ops

    device = torch.device("cpu" if smoke else "cuda")
    ops = get_ops("triton")
    bench = Bench(device, torch.bfloat16, smoke, 4800.0, 989.0, 25)
    with torch.inference_mode():
        # Decode: the split count at small batch, then the default choice at the shapes.
        sweep_shapes = [(1, 40, 4, 2, 64)] if smoke else [(1, 4096, 32, 8, 128), (4, 4096, 32, 8, 128)]
        default = tda.choose_num_splits
        for splits in (1, 2) if smoke else (4, 8, 16, 32, 64):
            tda.choose_num_splits = lambda *a, s=splits: s
            bench.tag = f"[splits={splits}]"
            bench_decode(bench, ops, ref, sweep_shapes)
        tda.choose_num_splits = default
        bench.tag = ""
        bench_decode(bench, ops, ref, [(2, 40, 4, 2, 64)] if smoke else [
            (1, 4096, 32, 8, 128), (32, 4096, 32, 8, 128), (64, 4096, 32, 8, 128), (128, 1024, 32, 8, 128)])
        bench_prefill(bench, ops, ref, [(2, 8, 20, 4, 2, 64)] if smoke else [
            (1, 0, 4096, 32, 8, 128), (1, 0, 8192, 32, 8, 128), (1, 0, 4096, 32, 8, 64), (1, 0, 8192, 32, 8, 64)])
        bench_int8(bench, ops, ref, [(3, 40, 64)] if smoke else [(1, 4096, 4096), (16, 4096, 4096),
                                                                 (64, 4096, 4096)])
    for r in bench.rows:
        rep.data.setdefault("kernels", []).append(r.__dict__)
    if not smoke:
        section_decode_kernel_only(rep, ops)
        section_linear_kernel_only(rep, ops)
    if not smoke and hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability() >= (8, 9):
        m = n = k = 4096
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        w_scale = w.abs().amax(dim=1, keepdim=True).float() / 448.0
        w8 = (w / w_scale).to(torch.float8_e4m3fn)

        def fp8_linear():
            x_scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / 448.0
            x8 = (x / x_scale).to(torch.float8_e4m3fn)
            return torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=torch.bfloat16)

        import triton.testing

        x_scale = x.abs().amax(dim=1, keepdim=True).float() / 448.0
        x8 = (x / x_scale).to(torch.float8_e4m3fn)
        t_gemm = triton.testing.do_bench(
            lambda: torch._scaled_mm(x8, w8.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=torch.bfloat16),
            warmup=10, rep=50)
        got, want = fp8_linear(), F.linear(x, w)
        rel = float((got.float() - want.float()).norm() / want.float().norm())
        t_fp8 = triton.testing.do_bench(fp8_linear, warmup=10, rep=50)
        t_bf16 = triton.testing.do_bench(lambda: F.linear(x, w), warmup=10, rep=50)
        flops = 2 * m * n * k
        rep.add("fp8_4096_gemm", {"fp8_gemm_ms": t_gemm},
                f"fp8 GEMM alone (_scaled_mm, rowwise scales) M=N=K=4096: {t_gemm:.3f} ms "
                f"{flops / t_gemm / 1e9:.0f} TFLOP/s = {t_bf16 / t_gemm:.2f}x bf16")
        rep.add("fp8_4096", {"fp8_ms": t_fp8, "bf16_ms": t_bf16, "rel_err": rel},
                f"fp8 W8A8 M=N=K=4096 (dynamic per-token activation scales included): {t_fp8:.3f} ms "
                f"{flops / t_fp8 / 1e9:.0f} TFLOP/s vs bf16 {t_bf16:.3f} ms = {t_bf16 / t_fp8:.2f}x, rel err {rel:.1e}")



def kernel_only_ms(fn, iters: int = 20) -> float:
    """Device time of fn's kernels alone (torch.profiler), the L2 flushed before each call: at small
    shapes do_bench's events also count the host's launch gaps, which a CUDA graph removes."""
    import torch

    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    return profiled_kernel_ms(prof, iters)



def _decode_kernel_case(rep, ops, batch: int, context: int) -> None:
    import torch
    import torch.nn.functional as F
    from kernels_gpu import contiguous_kv, paged_inputs

    heads, kv_heads, dim = 32, 8, 128
    k_cache, v_cache, tables = paged_inputs(torch, batch, context, 16, kv_heads, dim, torch.bfloat16, "cuda")
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn((batch, heads, dim), device="cuda").to(torch.bfloat16)
    gbs = 2 * batch * context * kv_heads * dim * 2 / 1e6  # GB/s at 1 ms
    times = {}
    for splits in (None, 1, 2, 4, 8, 16, 32, 64):
        times[splits] = kernel_only_ms(
            lambda s=splits: ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, dim**-0.5, num_splits=s))
    k, v = contiguous_kv(k_cache, tables, context), contiguous_kv(v_cache, tables, context)
    sdpa = kernel_only_ms(lambda: F.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True))
    best = min((t, s) for s, t in times.items() if s is not None)
    auto = times[None]
    rep.add(f"decode_kernel_only_{batch}x{context}", {"auto_ms": auto, "by_splits": times, "sdpa_ms": sdpa},
            f"decode attention kernels alone B={batch} ctx={context} H=32/8 D=128: auto {auto * 1e3:.1f} us "
            f"({gbs / auto:.0f} GB/s, {100 * gbs / auto / 4800:.0f}% of 4.8 TB/s); best splits={best[1]} "
            f"{best[0] * 1e3:.1f} us ({100 * gbs / best[0] / 4800:.0f}%); SDPA on contiguous K/V {sdpa * 1e3:.1f} us "
            f"({100 * gbs / sdpa / 4800:.0f}%)")



def section_decode_kernel_only(rep, ops) -> None:
    for batch, context in ((1, 4096), (4, 4096), (32, 4096), (64, 4096)):
        _decode_kernel_case(rep, ops, batch, context)



def section_linear_kernel_only(rep, ops) -> None:
    """int8 W8A16 and fp8 W8A8 (quantization of the activations included) against bf16 F.linear, kernels
    alone, N=K=4096."""
    import torch
    import torch.nn.functional as F
    from kvrelay.kernels import reference as ref

    w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    wq, ws = ops.quantize_int8(w)
    w8, w8s = ops.quantize_fp8(w)
    rq, rs = ref.quantize_fp8(w)
    exact = torch.equal(w8.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(w8s, rs)
    rep.add("quantize_fp8_exact", exact, f"quantize_fp8 on GPU bit-identical to its reference: {exact}")
    for m in (1, 16, 64, 4096):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        t_bf16 = kernel_only_ms(lambda x=x: F.linear(x, w))
        t_int8 = kernel_only_ms(lambda x=x: ops.int8_matmul(x, wq, ws))
        t_fp8 = kernel_only_ms(lambda x=x: ops.fp8_linear(x, w8, w8s))
        rel = float((ops.fp8_linear(x, w8, w8s).float() - F.linear(x, w).float()).norm()
                    / F.linear(x, w).float().norm())
        rep.add(f"linear_{m}", {"bf16_ms": t_bf16, "int8_ms": t_int8, "fp8_ms": t_fp8, "fp8_rel_err": rel},
                f"linear M={m} N=K=4096, kernels alone: bf16 {t_bf16 * 1e3:.1f} us, int8 W8A16 {t_int8 * 1e3:.1f} us "
                f"({t_bf16 / t_int8:.2f}x), fp8 W8A8 {t_fp8 * 1e3:.1f} us ({t_bf16 / t_fp8:.2f}x, rel err {rel:.1e})")

