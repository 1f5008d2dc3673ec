"""Compile every Triton kernel for a real GPU target (default sm_90, H100/H200) on a machine without one.

The interpreter accepts code a GPU compile rejects (tl.dot shapes, dtype mixes, loop-carried types);
this runs the public wrappers with CPU tensors while a compile-only driver makes each launch stop after
triton.compile has produced the cubin (ptxas ships with triton). Run as a script in a process
without TRITON_INTERPRET; prints one line per compiled kernel variant and exits non-zero on any
failure. `--ptxas-report` adds registers and spills per variant.
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

MAX_SHARED_BYTES = 227 * 1024  # per block on sm_90


class CompileOnlyDriver:
    """Just enough of a Triton driver for JITFunction.run to pick a target and compile."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target


def install(arch: int) -> list:
    driver.set_active(CompileOnlyDriver(arch))
    compiled = []
    original = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kwargs, kernel))
        return kernel

    JITFunction.run = compile_only
    return compiled


def exercise(ops) -> None:
    """Call each op with shapes that select every code path the GPU will see."""
    from kvrelay.kernels.triton_checksum import block_checksum, checksum
    from kvrelay.kernels.triton_rotary_kv import rotary_and_write_kv
    from kvrelay.kvtransfer.cuda_ipc import K1, K2

    checksum(torch.zeros(5, dtype=torch.int32), K1, K2)
    blocks, ids = torch.zeros((2, 2, 4, 16, 8, 64), dtype=torch.bfloat16), torch.zeros(2, dtype=torch.long)
    block_checksum(blocks, ids, 0, 2, K1, K2)
    block_checksum(blocks, ids, 0, 2, K1, K2, dst=blocks.clone(), dst_ids=ids)

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for head_dim, heads, kv_heads in ((8, 8, 4), (64, 8, 2), (128, 32, 8)):
            kv = torch.zeros((2, 8, 16, kv_heads, head_dim), dtype=dtype)
            tables = torch.zeros((3, 4), dtype=torch.int32)
            lens = torch.ones(3, dtype=torch.int32)
            q = torch.zeros((3, heads, head_dim), dtype=dtype)
            for splits in (1, 4):
                ops.paged_decode_attention(q, kv[0], kv[1], tables, lens, 0.1, num_splits=splits)
            qsl = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
            ops.paged_prefill_attention(q, kv[0], kv[1], tables, qsl, lens, 0.1)
            positions = torch.zeros(3, dtype=torch.int64)
            ops.rotary_embedding(positions, q, q[:, :kv_heads], torch.zeros((4, head_dim)))
            ops.write_kv(q[:, :kv_heads], q[:, :kv_heads], kv[0], kv[1], torch.zeros(3, dtype=torch.int64))
            rotary_and_write_kv(positions, q, q[:, :kv_heads], q[:, :kv_heads], torch.zeros((4, head_dim)),
                                kv[0], kv[1], torch.zeros(3, dtype=torch.int64))
        x = torch.zeros((5, 4096), dtype=dtype)
        ops.rms_norm(x, torch.zeros(4096, dtype=dtype), 1e-5)
        ops.fused_add_rms_norm(x, x, torch.zeros(4096, dtype=dtype), 1e-5)
        ops.silu_and_mul(torch.zeros((5, 2 * 14336), dtype=dtype))
        cache = torch.zeros((2, 2, 8, 16, 8, 128), dtype=dtype)
        ids = torch.zeros(3, dtype=torch.int32)
        ops.scatter_blocks(cache, ids, ops.gather_blocks(cache, ids, 0, 2), 0, 2)
        w = torch.zeros((256, 512), dtype=dtype)
        ops.quantize_int8(w)
        wq, scale = torch.zeros((256, 512), dtype=torch.int8), torch.zeros(256)
        for m in (1, 40, 300):
            ops.int8_matmul(torch.zeros((m, 512), dtype=dtype), wq, scale, torch.zeros(256, dtype=dtype))
        # Fused MoE at Mixtral-like proportions (small): decode, mid and prefill tile classes, and int8.
        w13, w2 = torch.zeros((8, 2 * 448, 256), dtype=dtype), torch.zeros((8, 256, 448), dtype=dtype)
        q13, q2 = torch.zeros((8, 2 * 448, 256), dtype=torch.int8), torch.zeros((8, 256, 448), dtype=torch.int8)
        for m in (1, 200, 600):
            x = torch.zeros((m, 256), dtype=dtype)
            ids = torch.zeros((m, 2), dtype=torch.int64)
            weights = torch.zeros((m, 2))
            ops.fused_moe(x, w13, w2, weights, ids)
            ops.fused_moe(x, q13, q2, weights, ids, torch.zeros((8, 896)), torch.zeros((8, 256)))
            ops.fused_moe(x, q13.view(torch.float8_e4m3fn), q2.view(torch.float8_e4m3fn), weights, ids,
                          torch.zeros((8, 896)), torch.zeros((8, 256)))


def count_recompiles(ops) -> dict[str, int]:
    """New compiled variants while batch size, table width and token count change step to step."""
    from kvrelay.kernels import triton_decode_attention, triton_int8, triton_moe, triton_prefill_attention

    kernels = {
        "decode": triton_decode_attention._decode_kernel,
        "prefill": triton_prefill_attention._prefill_kernel,
        "int8_matmul": triton_int8._int8_matmul_kernel,
        "moe_gate_up": triton_moe._gate_up_kernel,
        "moe_down": triton_moe._down_kernel,
    }
    before = {name: len(k.device_caches[0][0]) for name, k in kernels.items()}
    kv = torch.zeros((2, 64, 16, 8, 128), dtype=torch.bfloat16)
    wq, scale = torch.zeros((256, 512), dtype=torch.int8), torch.zeros(256)
    bias = torch.zeros(256, dtype=torch.bfloat16)
    w13 = torch.zeros((8, 2 * 256, 512), dtype=torch.bfloat16)
    w2 = torch.zeros((8, 512, 256), dtype=torch.bfloat16)
    for batch in (1, 3, 8, 16, 17):
        for width in (1, 2, 5, 16, 33):
            tables = torch.zeros((batch, width), dtype=torch.int32)
            lens = torch.ones(batch, dtype=torch.int32)
            q = torch.zeros((batch, 32, 128), dtype=torch.bfloat16)
            ops.paged_decode_attention(q, kv[0], kv[1], tables, lens, 0.1, num_splits=1)
            chunk = torch.zeros((batch * 7 + 1, 32, 128), dtype=torch.bfloat16)
            qsl = torch.arange(batch + 1, dtype=torch.int32)
            ops.paged_prefill_attention(chunk, kv[0], kv[1], tables, qsl, lens, 0.1)
        ops.int8_matmul(torch.zeros((batch, 512), dtype=torch.bfloat16), wq, scale, bias)
        ops.fused_moe(torch.zeros((batch, 512), dtype=torch.bfloat16), w13, w2, torch.zeros((batch, 2)),
                      torch.zeros((batch, 2), dtype=torch.int64))
    return {name: len(k.device_caches[0][0]) - before[name] for name, k in kernels.items()}


def ptxas_report(ptx: str, arch: int) -> str:
    """Registers and spills as ptxas reports them (the bundled ptxas that accepts triton's PTX)."""
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        for ptxas in ("ptxas-blackwell", "ptxas"):
            cmd = [str(bin_dir / ptxas), f"-arch=sm_{arch}a", "-v", str(src), "-o", str(src) + ".o"]
            out = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if out.returncode == 0:
                lines = (out.stdout + out.stderr).splitlines()
                wanted = [line for line in lines if "egisters" in line or "spill" in line]
                return "; ".join(line.split(":", 1)[-1].strip() for line in wanted)
    return "ptxas failed"


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    arch = int(args[0]) if args else 90
    compiled = install(arch)
    from kvrelay.kernels import triton_ops

    exercise(triton_ops)
    too_big = []
    seen = set()
    for name, kwargs, kernel in compiled:
        consts = {k: v for k, v in kwargs.items() if k.isupper()}
        key = (name, repr(sorted(consts.items())))
        if key in seen:
            continue
        seen.add(key)
        shared = kernel.metadata.shared
        extra = f" | {ptxas_report(kernel.asm['ptx'], arch)}" if "--ptxas-report" in sys.argv else ""
        print(f"{name:<24} shared={shared:>7} warps={kernel.metadata.num_warps} {consts}{extra}")
        if shared > MAX_SHARED_BYTES:
            too_big.append(name)
        assert "cubin" in kernel.asm, name
    print(f"compiled {len(seen)} kernel variants for sm_{arch}")
    recompiles = count_recompiles(triton_ops)
    print(f"new variants while the batch changed: {recompiles}")
    if any(n > 1 for n in recompiles.values()):
        print("a kernel recompiles as the batch changes")
        return 1
    if too_big:
        print(f"shared memory over {MAX_SHARED_BYTES} bytes: {too_big}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
