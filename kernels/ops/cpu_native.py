"""Native CPU kernels: C sources in kernels/ops/csrc, compiled on first use and loaded with ctypes.

Why C and not torch: plain torch has no op that reads a block table in place, so the reference
decode attention gathers every sequence's blocks into a padded copy and reads it back, three
passes over the KV bytes; decode attention is memory-bound, so this is most of its cost on CPU.
The norms, rotary embedding and KV write are one pass each where the references chain several
torch ops, each with its own pass and per-op overhead.

The library is built with the machine's C compiler (`$CC`, default `cc`) with -march=native and
OpenMP, into a cache folder ($KVRELAY_KERNEL_CACHE, default ~/.cache/kvrelay/kernels) under a name
keyed by the sources, the flags, the compiler and the CPU, so a shared home folder never serves
one machine's build to another. It links OpenMP by soname, so in-process it shares the OpenMP
runtime torch already loaded (one thread pool); every call passes torch's thread count.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch
from kvrelay.kernels.reference import PackedWeight

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "csrc"
SOURCES = ("paged_decode_attention.c", "elementwise.c", "linear.c")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared") + (
    ("-mprefer-vector-width=512",) if platform.machine() in ("x86_64", "AMD64") else ()  # gcc picks 256 bits
)
# glibc's vector math library, for the attention softmax's expf (see paged_decode_attention.c).
_X86_GLIBC = platform.machine() in ("x86_64", "AMD64") and platform.libc_ver()[0] == "glibc"
LIBS = ("-lmvec", "-lm") if _X86_GLIBC else ("-lm",)
BUILD_TIMEOUT_S = 120

_DTYPE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_P, _I, _F, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int  # _N: thread count
_ARGTYPES = {
    **{f"paged_decode_attention_{s}": [_P] * 5 + [_I, _P] + [_I] * 8 + [_F, _I, _F, _N] for s in ("f32", "bf16", "f16")},
    "add_rms_norm_f32": [_P] * 5 + [_I] * 4 + [_F, _N],
    "rotary_f32": [_P] * 4 + [_I] * 5 + [_N],
    "write_kv_rows": [_P] * 5 + [_I] * 5,
    "scatter_blocks_rows": [_P] * 3 + [_I] * 5,
    "copy_blocks_rows": [_P] * 4 + [_I] * 6,
    "packed_linear_f32": [_P] + [_I] * 3 + [_P, _I, _P, _P, _N],
    "packed_linear_f32_available": [],
}
_RETURN_NOTHING = {"add_rms_norm_f32", "packed_linear_f32"}  # the rest return a status or a flag


class NativeKernelsUnavailable(RuntimeError):
    """The C kernels could not be built or loaded on this machine (the message says why)."""


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _compiler_version(cc: str) -> str:
    try:
        done = subprocess.run([cc, "--version"], check=False, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NativeKernelsUnavailable(
            f"no C compiler: running {cc!r} failed ({exc}); install gcc or set CC, or use "
            "--kernel-backend torch"
        ) from exc
    return done.stdout


def _cache_dir() -> Path:
    base = os.environ.get("KVRELAY_KERNEL_CACHE")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvrelay" / "kernels"


def build(cc: str | None = None) -> Path:
    """The compiled library's path, compiling it first when no build for this key exists."""
    cc = cc or os.environ.get("CC", "cc")
    key = hashlib.sha256()
    for name in sorted(p.name for p in SOURCE_DIR.iterdir() if p.suffix in (".c", ".h")):
        key.update(name.encode() + b"\0" + (SOURCE_DIR / name).read_bytes())
    key.update(" ".join(CFLAGS + LIBS).encode() + _compiler_version(cc).encode() + _cpu_signature().encode())
    target = _cache_dir() / f"kvrelay_cpu_kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # Compile to a private name, then rename: processes racing to build never load a half file.
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    except OSError as exc:
        raise NativeKernelsUnavailable(
            f"cannot write the kernel cache folder {target.parent} ({exc}): set KVRELAY_KERNEL_CACHE "
            "to a writable folder"
        ) from exc
    os.close(fd)
    cmd = [cc, *CFLAGS, "-o", tmp, *(str(SOURCE_DIR / s) for s in SOURCES), *LIBS]
    try:
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise NativeKernelsUnavailable(f"compiling the CPU kernels failed: {' '.join(cmd)}\n{done.stderr}")
        os.replace(tmp, target)
    except subprocess.TimeoutExpired as exc:
        raise NativeKernelsUnavailable(f"compiling the CPU kernels took over {BUILD_TIMEOUT_S} s") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built native CPU kernels: %s", target)
    return target


def library() -> ctypes.CDLL:
    """The loaded kernels (built on first call); raises NativeKernelsUnavailable."""
    lib = _load()
    if isinstance(lib, str):
        raise NativeKernelsUnavailable(lib)
    return lib


@functools.cache
def _load() -> ctypes.CDLL | str:
    """The library, or why it is unavailable: a failure is remembered too, not retried per call."""
    if os.environ.get("KVRELAY_NATIVE_KERNELS", "1") == "0":
        return "native CPU kernels disabled by KVRELAY_NATIVE_KERNELS=0"
    try:
        path = build()
    except NativeKernelsUnavailable as exc:
        return str(exc)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return f"loading {path} failed: {exc}"
    for name, argtypes in _ARGTYPES.items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = None if name in _RETURN_NOTHING else ctypes.c_int
    return lib


def unavailable_reason() -> str | None:
    """None when the native kernels load here, else why not."""
    try:
        library()
    except NativeKernelsUnavailable as exc:
        return str(exc)
    return None


def supports_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether paged_decode_attention runs these tensors natively (else callers use the reference)."""
    if q.device.type != "cpu" or q.dtype not in _DTYPE_SUFFIX:
        return False
    if not (k_cache.dtype == v_cache.dtype == q.dtype and k_cache.stride() == v_cache.stride()):
        return False
    kv_heads, head_dim = k_cache.shape[2:]
    # Rows of one block must be packed as [block_size, Hkv, D]; blocks may sit at any stride.
    return k_cache.stride()[1:] == (kv_heads * head_dim, head_dim, 1) and q.shape[1] % kv_heads == 0


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """kvrelay.kernels.reference.paged_decode_attention, reading K/V in place. q[B, Hq, D] -> [B, Hq, D].

    The caller checks supports_decode first.
    """
    q = q.contiguous()
    out = torch.empty_like(q)
    batch, num_heads, head_dim = q.shape
    if batch == 0:
        return out
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    max_len = int(lens.max())
    if max_len > tables.shape[1] * block_size:
        raise ValueError(f"a sequence of {max_len} tokens needs more than the block table's {tables.shape[1]} blocks")
    fn = getattr(library(), f"paged_decode_attention_{_DTYPE_SUFFIX[q.dtype]}")
    status = fn(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), tables.data_ptr(),
        tables.shape[1], lens.data_ptr(), batch, num_heads, kv_heads, head_dim, block_size,
        k_cache.stride()[0], num_blocks, max_len, scale, window or 0, softcap or 0.0, torch.get_num_threads(),
    )
    if status == -2:
        raise ValueError(f"a block table entry lies outside the KV cache's {num_blocks} blocks")
    if status != 0:
        raise MemoryError("native decode attention could not allocate its scratch buffers")
    return out


# ---- elementwise (fp32) -----------------------------------------------------------------------


def _fp32_rows(x: torch.Tensor) -> bool:
    """An fp32 CPU matrix whose rows are packed (any row stride)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1


def _as_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as [rows, last dim] without a copy, when its rows are packed; else None."""
    if x.dim() == 2:
        return x if x.stride(1) == 1 else None
    return x.view(-1, x.shape[-1]) if x.is_contiguous() else None


def supports_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    if weight.dtype != torch.float32 or not weight.is_contiguous():
        return False
    if residual is not None and residual.shape != x.shape:
        return False
    tensors = (x,) if residual is None else (x, residual)
    return all(rows is not None and _fp32_rows(rows) for rows in map(_as_rows, tensors))


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """rms_norm(x) or rms_norm(x + residual) and the sum; the caller checks supports_norm first."""
    xr = _as_rows(x)
    rr = _as_rows(residual) if residual is not None else None
    out = torch.empty(x.shape, dtype=torch.float32)
    summed = torch.empty(x.shape, dtype=torch.float32) if residual is not None else None
    library().add_rms_norm_f32(
        xr.data_ptr(), rr.data_ptr() if rr is not None else None, weight.data_ptr(), out.data_ptr(),
        summed.data_ptr() if summed is not None else None, xr.shape[0], xr.shape[1], xr.stride(0),
        rr.stride(0) if rr is not None else 0, eps, torch.get_num_threads(),
    )
    return out, summed


def supports_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> bool:
    return (
        q.device.type == "cpu" and q.dtype == k.dtype == cos_sin_cache.dtype == torch.float32
        and positions.dtype == torch.int64 and cos_sin_cache.is_contiguous()
        and q.dim() == k.dim() == 3 and q.shape[-1] == k.shape[-1] == cos_sin_cache.shape[-1]
        and q.stride()[1:] == (q.shape[2], 1) and k.stride()[1:] == (k.shape[2], 1)
    )


def rotary_embedding(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The caller checks supports_rotary first."""
    positions = positions.contiguous()
    lib = library()
    outs = []
    for x in (q, k):
        out = torch.empty(x.shape, dtype=torch.float32)
        status = lib.rotary_f32(positions.data_ptr(), x.data_ptr(), out.data_ptr(), cos_sin_cache.data_ptr(),
                                x.shape[0], x.shape[1], x.shape[2], x.stride(0), cos_sin_cache.shape[0],
                                torch.get_num_threads())
        if status != 0:
            raise IndexError(f"positions must lie in [0, {cos_sin_cache.shape[0]}) (the rotary table's size)")
        outs.append(out)
    return outs[0], outs[1]


def supports_write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> bool:
    """Same dtype throughout, token rows packed [Hkv, D] in the inputs, caches contiguous per layer."""
    if key.device.type != "cpu" or not (key.dtype == value.dtype == k_cache.dtype == v_cache.dtype):
        return False
    if slot_mapping.dtype != torch.int64 or key.shape != value.shape or key.dim() != 3:
        return False
    packed = (key.shape[2], 1)
    return (key.stride()[1:] == packed and value.stride()[1:] == packed and k_cache.is_contiguous()
            and v_cache.is_contiguous() and k_cache.shape[2:] == key.shape[1:])


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """The caller checks supports_write_kv first."""
    slots = slot_mapping.contiguous()
    size = key.element_size()
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    status = library().write_kv_rows(
        key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
        key.shape[0], key.shape[1] * key.shape[2] * size, key.stride(0) * size, value.stride(0) * size, num_slots,
    )
    if status != 0:
        raise IndexError(f"a slot lies past the KV cache's {num_slots} slots")


def supports_scatter_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor,
                            layer_start: int, layer_end: int) -> bool:
    """CPU tensors of one dtype, both contiguous, the buffer exactly gather_blocks' shape."""
    if kv_cache.device.type != "cpu" or buffer.device.type != "cpu" or buffer.dtype != kv_cache.dtype:
        return False
    want = (layer_end - layer_start, 2, block_ids.numel(), *kv_cache.shape[3:])
    return (0 <= layer_start < layer_end <= kv_cache.shape[0] and tuple(buffer.shape) == want
            and kv_cache.is_contiguous() and buffer.is_contiguous() and block_ids.dim() == 1)


def scatter_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, buffer: torch.Tensor, layer_start: int,
                   layer_end: int) -> None:
    """The caller checks supports_scatter_blocks first."""
    ids = block_ids.to(torch.int64).contiguous()
    block_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
    status = library().scatter_blocks_rows(
        kv_cache.data_ptr(), buffer.data_ptr(), ids.data_ptr(), ids.numel(), layer_end - layer_start, layer_start,
        kv_cache.shape[2], block_bytes)
    if status != 0:
        raise IndexError(f"a block id lies outside the KV cache's {kv_cache.shape[2]} blocks")


def supports_copy_blocks(dst_cache: torch.Tensor, dst_ids: torch.Tensor, src_cache: torch.Tensor,
                         src_ids: torch.Tensor, layer_start: int, layer_end: int) -> bool:
    """Contiguous CPU caches of one dtype and block shape, one id list per side of equal length."""
    return (dst_cache.device.type == src_cache.device.type == "cpu" and dst_cache.dtype == src_cache.dtype
            and dst_cache.dim() == src_cache.dim() == 6 and dst_cache.shape[:2] == src_cache.shape[:2]
            and dst_cache.shape[3:] == src_cache.shape[3:] and dst_cache.is_contiguous()
            and src_cache.is_contiguous() and 0 <= layer_start < layer_end <= dst_cache.shape[0]
            and dst_ids.dim() == src_ids.dim() == 1 and dst_ids.numel() == src_ids.numel())


def copy_blocks(dst_cache: torch.Tensor, dst_ids: torch.Tensor, src_cache: torch.Tensor, src_ids: torch.Tensor,
                layer_start: int, layer_end: int) -> None:
    """The caller checks supports_copy_blocks first."""
    d, s = dst_ids.to(torch.int64).contiguous(), src_ids.to(torch.int64).contiguous()
    block_bytes = dst_cache[0, 0, 0].numel() * dst_cache.element_size()
    status = library().copy_blocks_rows(
        dst_cache.data_ptr(), src_cache.data_ptr(), d.data_ptr(), s.data_ptr(), d.numel(), layer_end - layer_start,
        layer_start, dst_cache.shape[2], src_cache.shape[2], block_bytes)
    if status != 0:
        raise IndexError(f"a block id lies outside its cache ({dst_cache.shape[2]} blocks to, {src_cache.shape[2]} "
                         f"from)")


# ---- linear over packed weights (fp32) --------------------------------------------------------


def packed_linear_available() -> bool:
    """Whether this build has the packed fp32 linear kernel (AVX2 machines without AVX-512)."""
    return unavailable_reason() is None and bool(library().packed_linear_f32_available())


def packed_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """kvrelay.kernels.reference.packed_linear for fp32 CPU x [..., K]; bias fp32 [N] or None."""
    k = packed.data.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"linear input has {x.shape[-1]} features, the weight expects {k}")
    n = packed.out_features
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"linear bias has shape {tuple(bias.shape)}, the weight expects ({n},)")
    rows = _as_rows(x)
    if rows is None:
        rows = x.reshape(-1, k).contiguous()
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    if rows.shape[0]:
        library().packed_linear_f32(
            rows.data_ptr(), rows.shape[0], k, rows.stride(0), packed.data.data_ptr(), n,
            bias.data_ptr() if bias is not None else None, out.data_ptr(), torch.get_num_threads(),
        )
    return out.view(*x.shape[:-1], n)
