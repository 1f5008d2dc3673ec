"""Benchmark every Triton kernel against torch on one GPU, after re-checking it against the reference.

    python benchmarks/kernels_gpu.py               # H200: under 8 minutes
    python benchmarks/kernels_gpu.py --cpu-smoke   # no GPU: tiny shapes in Triton's interpreter

Per kernel and shape it prints the Triton time, achieved bandwidth as a share of HBM peak (memory-bound
kernels) or TFLOP/s as a share of dense bf16 peak (prefill attention, larger int8 matmuls), and the
same for torch's own path measured in the same run: F.scaled_dot_product_attention on contiguous K/V
for attention, eager ops (the kvrelay.kernels.reference functions) for the rest. Peaks default to an
H200 (4.8 TB/s, 989 dense bf16 TFLOP/s); change them with --peak-gbs / --peak-tflops.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from kernels_gpu_cases import bench_blocks, bench_elementwise, bench_int8, bench_moe

ROOT = Path(__file__).resolve().parents[1]


def _import_kernels_package() -> None:
    """Use the installed kvrelay; on a bare GPU box (torch + triton only) map kernels/ops/ directly."""
    try:
        import kvrelay.kernels  # noqa: F401
    except ImportError:
        root = types.ModuleType("kvrelay")
        root.__path__ = []
        kernels = types.ModuleType("kvrelay.kernels")
        kernels.__path__ = [str(ROOT / "kernels" / "ops")]
        sys.modules["kvrelay"], sys.modules["kvrelay.kernels"] = root, kernels


@dataclass
class Row:
    kernel: str
    shape: str
    triton_ms: float
    torch_ms: float | None
    torch_label: str
    nbytes: float | None  # bytes moved, for memory-bound kernels
    flops: float | None  # useful FLOPs, for compute-bound kernels
    max_err: float
    ok: bool


class Bench:
    def __init__(self, device, dtype, smoke: bool, peak_gbs: float, peak_tflops: float, iters: int):
        import torch

        self.torch = torch
        self.device = device
        self.dtype = dtype
        self.smoke = smoke
        self.peak_gbs = peak_gbs
        self.peak_tflops = peak_tflops
        self.iters = iters
        self.rows: list[Row] = []
        self.tag = ""  # appended to kernel names while sweeping launch configs

    def time_ms(self, fn: Callable[[], object]) -> float:
        if self.smoke:  # the interpreter: one call, wall clock (meaningless, but exercises the path)
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=self.iters)

    def check(self, got, want, atol: float, rtol: float) -> tuple[float, bool]:
        torch = self.torch
        pairs = list(zip(got, want)) if isinstance(got, tuple) else [(got, want)]
        err, ok = 0.0, True
        for g, w in pairs:
            diff = (g.float() - w.float()).abs()
            err = max(err, float(diff.max()) if diff.numel() else 0.0)
            ok = (
                ok
                and bool(torch.isfinite(g.float()).all())
                and bool((diff <= atol + rtol * w.float().abs()).all())
            )
        return err, ok

    def add(
        self,
        kernel,
        shape,
        triton_fn,
        torch_fn,
        torch_label,
        want,
        got,
        nbytes=None,
        flops=None,
        atol=2e-2,
        rtol=2e-2,
    ):
        err, ok = self.check(got, want, atol, rtol)
        triton_ms = self.time_ms(triton_fn)
        torch_ms = self.time_ms(torch_fn) if torch_fn is not None else None
        row = Row(kernel + self.tag, shape, triton_ms, torch_ms, torch_label, nbytes, flops, err, ok)
        self.rows.append(row)
        print(format_row(row, self.peak_gbs, self.peak_tflops), flush=True)


HEADER = (
    f"{'kernel':<32} {'shape':<34} {'triton ms':>10} {'rate':>16} {'% peak':>7} | "
    f"{'torch path':<14} {'ms':>9} {'rate':>16} {'speedup':>8} | {'max err':>8} ok"
)


def _rate(ms: float, nbytes, flops, peak_gbs, peak_tflops) -> tuple[str, str]:
    if ms <= 0:
        return "-", "-"
    if flops is not None:
        tflops = flops / ms / 1e9
        return f"{tflops:9.1f} TFLOP/s", f"{100 * tflops / peak_tflops:6.1f}%"
    if nbytes is not None:
        gbs = nbytes / ms / 1e6
        return f"{gbs:10.1f} GB/s", f"{100 * gbs / peak_gbs:6.1f}%"
    return "-", "-"


def format_row(r: Row, peak_gbs: float, peak_tflops: float) -> str:
    rate, pct = _rate(r.triton_ms, r.nbytes, r.flops, peak_gbs, peak_tflops)
    if r.torch_ms is None:
        trate, tms, speed = "-", "-", "-"
    else:
        trate = _rate(r.torch_ms, r.nbytes, r.flops, peak_gbs, peak_tflops)[0]
        tms, speed = f"{r.torch_ms:9.3f}", f"{r.torch_ms / r.triton_ms:7.2f}x"
    return (
        f"{r.kernel:<32} {r.shape:<34} {r.triton_ms:10.3f} {rate:>16} {pct:>7} | "
        f"{r.torch_label:<14} {tms:>9} {trate:>16} {speed:>8} | {r.max_err:8.1e} {'yes' if r.ok else 'NO'}"
    )


def paged_inputs(torch, batch, context, block_size, num_kv_heads, head_dim, dtype, device, seed=0):
    """A paged layer cache holding `batch` sequences of `context` tokens in shuffled blocks."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, device=device, dtype=dtype)  # on the device: GBs at the large shapes
    v_cache = torch.randn(shape, device=device, dtype=dtype)
    tables = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_seq).to(torch.int32).to(device)
    return k_cache, v_cache, tables


def contiguous_kv(cache, tables, context):
    """[B, Hkv, context, D] copies of the paged context, for torch's SDPA."""
    return cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()


def bench_decode(b: Bench, ops, ref, shapes):
    torch = b.torch
    F = torch.nn.functional
    for batch, context, heads, kv_heads, head_dim in shapes:
        k_cache, v_cache, tables = paged_inputs(
            torch, batch, context, 16, kv_heads, head_dim, b.dtype, b.device
        )
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=b.device)
        q = torch.randn((batch, heads, head_dim), device=b.device).to(b.dtype)
        scale = head_dim**-0.5
        got = ops.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale)
        want = ref.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, scale)
        k, v = contiguous_kv(k_cache, tables, context), contiguous_kv(v_cache, tables, context)
        sdpa = partial(F.scaled_dot_product_attention, q.unsqueeze(2), k, v, scale=scale, enable_gqa=True)
        nbytes = (
            2 * batch * context * kv_heads * head_dim * k_cache.element_size()
            + 2 * q.numel() * q.element_size()
        )
        b.add(
            "decode_attention",
            f"B={batch} ctx={context} H={heads}/{kv_heads} D={head_dim}",
            partial(ops.paged_decode_attention, q, k_cache, v_cache, tables, seq_lens, scale),
            sdpa,
            "sdpa(contig)",
            want,
            got,
            nbytes=nbytes,
        )
        del k, v, sdpa


def bench_prefill(b: Bench, ops, ref, shapes):
    torch = b.torch
    F = torch.nn.functional
    for num_seqs, prefix, chunk, heads, kv_heads, head_dim in shapes:
        context = prefix + chunk
        k_cache, v_cache, tables = paged_inputs(
            torch, num_seqs, context, 16, kv_heads, head_dim, b.dtype, b.device
        )
        seq_lens = torch.full((num_seqs,), context, dtype=torch.int32, device=b.device)
        qsl = torch.arange(0, (num_seqs + 1) * chunk, chunk, dtype=torch.int32, device=b.device)
        q = torch.randn((num_seqs * chunk, heads, head_dim), device=b.device).to(b.dtype)
        scale = head_dim**-0.5
        got = ops.paged_prefill_attention(q, k_cache, v_cache, tables, qsl, seq_lens, scale)
        want = ref.paged_prefill_attention(q, k_cache, v_cache, tables, qsl, seq_lens, scale)
        k, v = contiguous_kv(k_cache, tables, context), contiguous_kv(v_cache, tables, context)
        q4 = q.view(num_seqs, chunk, heads, head_dim).transpose(1, 2)
        if prefix == 0:
            mask = None
        else:  # chunk rows sit at the end of the context
            rows = torch.arange(prefix, context, device=b.device)[:, None]
            mask = torch.arange(context, device=b.device)[None, :] <= rows
        sdpa = partial(
            F.scaled_dot_product_attention,
            q4,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )

        # Useful FLOPs only (masked-out half of the causal square not counted): 2 matmuls x 2 flops.
        visible = chunk * prefix + chunk * (chunk + 1) / 2
        flops = 4 * num_seqs * heads * head_dim * visible
        b.add(
            "prefill_attention",
            f"seqs={num_seqs} prefix={prefix} chunk={chunk} H={heads}/{kv_heads} D={head_dim}",
            partial(ops.paged_prefill_attention, q, k_cache, v_cache, tables, qsl, seq_lens, scale),
            sdpa,
            "sdpa(contig)",
            want,
            got,
            flops=flops,
        )
        fresh = getattr(ops, "fresh_prefill_attention", None)  # FlashAttention varlen, chunks without a prefix
        if prefix == 0 and fresh is not None:
            k_new, v_new = (t.transpose(1, 2).reshape(num_seqs * chunk, kv_heads, head_dim) for t in (k, v))
            flash = partial(fresh, q, k_new, v_new, qsl, chunk, scale)
            if flash() is not None:
                b.add("prefill_attention_flash", f"seqs={num_seqs} chunk={chunk} H={heads}/{kv_heads} D={head_dim}",
                      flash, sdpa, "sdpa(contig)", want, flash(), flops=flops)
        del k, v, sdpa


def sweep_configs(b: Bench, ops, ref, smoke: bool) -> None:
    """Re-run the target shapes under alternative launch configs, for tuning on the device."""
    from kvrelay.kernels import triton_decode_attention, triton_prefill_attention

    default_stages = triton_decode_attention.DECODE_STAGES
    for stages in (5,):  # 3 (default) keeps one K/V tile in flight per program, 5 two
        triton_decode_attention.DECODE_STAGES = stages
        b.tag = f"[stages={stages}]"
        bench_decode(
            b, ops, ref, [(2, 40, 4, 2, 64)] if smoke else [(32, 4096, 32, 8, 128), (64, 4096, 32, 8, 128)]
        )
    triton_decode_attention.DECODE_STAGES = default_stages
    default_tiles = triton_prefill_attention._tile_config
    for tiles in ((128, 128, 8, 2), (128, 64, 8, 5), (128, 32, 4, 3), (64, 64, 4, 3)):
        triton_prefill_attention._tile_config = lambda head_dim, dtype, tiles=tiles: tiles
        b.tag = "[{}x{} w{} s{}]".format(*tiles)
        bench_prefill(b, ops, ref, [(2, 8, 20, 4, 2, 64)] if smoke else [(1, 0, 4096, 32, 8, 128)])
    triton_prefill_attention._tile_config = default_tiles
    b.tag = ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny shapes on CPU in Triton's interpreter: checks correctness, times nothing useful",
    )
    parser.add_argument(
        "--only", default="", help="comma-separated kernel families: decode,prefill,elementwise,blocks,int8,moe"
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also time decode/prefill attention under alternative launch configs (tuning)",
    )
    parser.add_argument("--iters-ms", type=int, default=100, help="measuring time per case for do_bench")
    parser.add_argument("--peak-gbs", type=float, default=4800.0, help="HBM peak GB/s (H200: 4800)")
    parser.add_argument(
        "--peak-tflops", type=float, default=989.0, help="dense bf16 peak TFLOP/s (H200: 989)"
    )
    args = parser.parse_args(argv)

    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
    _import_kernels_package()
    import torch
    from kvrelay.kernels import reference as ref
    from kvrelay.kernels.registry import get_ops

    if args.cpu_smoke:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("no CUDA device: run with --cpu-smoke for the interpreter check", file=sys.stderr)
        return 2
    ops = get_ops("triton")
    torch.manual_seed(0)
    bench = Bench(device, torch.bfloat16, args.cpu_smoke, args.peak_gbs, args.peak_tflops, args.iters_ms)
    families = set(filter(None, args.only.split(","))) or {
        "decode",
        "prefill",
        "elementwise",
        "blocks",
        "int8",
        "moe",
    }
    started = time.perf_counter()
    label = (
        "CPU interpreter smoke run (times are not meaningful)"
        if args.cpu_smoke
        else torch.cuda.get_device_name()
    )
    print(f"# {label}; dtype bf16; peaks {args.peak_gbs:.0f} GB/s, {args.peak_tflops:.0f} TFLOP/s")
    print(HEADER)
    smoke = args.cpu_smoke
    with torch.inference_mode():
        if "decode" in families:
            bench_decode(
                bench,
                ops,
                ref,
                [(2, 40, 4, 2, 64), (1, 33, 8, 1, 128)]
                if smoke
                else [
                    (1, 4096, 32, 8, 128),
                    (32, 4096, 32, 8, 128),
                    (64, 4096, 32, 8, 128),
                    (32, 16384, 32, 8, 128),
                    (128, 1024, 32, 8, 128),
                    (32, 4096, 64, 8, 128),
                    (256, 512, 32, 8, 128),
                ],
            )
        if "prefill" in families:
            bench_prefill(
                bench,
                ops,
                ref,
                [(2, 8, 20, 4, 2, 64)]
                if smoke
                else [
                    (1, 0, 4096, 32, 8, 128),
                    (1, 0, 8192, 32, 8, 128),
                    (1, 2048, 2048, 32, 8, 128),
                    (4, 0, 1024, 32, 8, 128),
                    (1, 0, 4096, 32, 8, 64),
                ],
            )
        if args.sweep:
            sweep_configs(bench, ops, ref, smoke)
        if "elementwise" in families:
            if smoke:
                bench_elementwise(bench, ops, ref, 5, 64, 48, 4, 2, 16)
            else:
                bench_elementwise(bench, ops, ref, 8192, 4096, 14336, 32, 8, 128)
        if "blocks" in families:
            if smoke:
                bench_blocks(bench, ops, ref, 2, 6, 3, 2, 16)
            else:
                bench_blocks(bench, ops, ref, 32, 2048, 256, 8, 128)
        if "int8" in families:
            bench_int8(
                bench,
                ops,
                ref,
                [(3, 40, 64)]
                if smoke
                else [
                    (1, 4096, 4096),
                    (16, 14336, 4096),
                    (256, 4096, 4096),
                    (4096, 4096, 4096),
                ],
            )
        if "moe" in families:  # Mixtral-8x7B layer shapes: decode-sized (GB/s) and prefill-sized (TFLOP/s)
            bench_moe(bench, ops, [(5, 64, 48, 8, 2), (40, 64, 48, 8, 2)] if smoke
                      else [(16, 4096, 14336, 8, 2), (4096, 4096, 14336, 8, 2)])
    failed = [r for r in bench.rows if not r.ok]
    mismatches = ", ".join(f"{r.kernel} {r.shape}" for r in failed)
    verdict = f"MISMATCH: {mismatches}" if failed else "all correct"
    print(f"# {len(bench.rows)} cases in {time.perf_counter() - started:.1f} s; {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
