"""`kvrelay env`: what a bug report needs, in one block: versions (kvrelay, Python, torch,
triton and the main libraries), CUDA and the driver when present, the CPU's vector flags, whether
the native CPU kernels build here, and which plugins load."""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path

PACKAGES = ("torch", "triton", "numpy", "safetensors", "tokenizers", "transformers", "grpcio", "protobuf",
            "fastapi", "uvicorn", "redis", "kopf")
CPU_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16",
             "amx_tile", "amx_bf16", "neon", "asimd", "sve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    parser.add_argument("--plugins", default=None, help="report as if started with this --plugins value")


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpu() -> dict:
    info = {"machine": platform.machine(), "model": platform.processor() or "unknown", "flags": []}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name":
            info["model"] = value.strip()
        elif key in ("flags", "Features"):
            flags.update(value.split())
    info["flags"] = [f for f in CPU_FLAGS if f in flags]
    return info


def _cuda() -> dict:
    import torch

    out: dict = {"torch_cuda": torch.version.cuda or "none (CPU build)", "available": torch.cuda.is_available()}
    if out["available"]:
        out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if shutil.which("nvidia-smi"):
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              check=False, capture_output=True, text=True, timeout=30)
        out["driver"] = done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None
    return out


def _native() -> dict:
    from kvrelay.kernels import cpu_native

    reason = cpu_native.unavailable_reason()
    if reason is not None:
        return {"status": "unavailable", "reason": reason}
    return {"status": "built", "library": str(cpu_native.build()),
            "packed_linear": cpu_native.packed_linear_available()}


def _plugins(spec: str | None) -> dict:
    from kvrelay.plugins import PluginError, load_plugins

    try:
        loaded = load_plugins(spec)
    except PluginError as exc:
        return {"error": str(exc)}
    return {group: {name: p.distribution for name, p in found.items()} for group, found in loaded.items()}


def report(plugins_spec: str | None = None) -> dict:
    return {
        "kvrelay": _version("kvrelay"),
        "python": f"{platform.python_version()} ({platform.python_implementation()}, {platform.platform()})",
        "packages": {name: _version(name) for name in PACKAGES},
        "cuda": _cuda(),
        "cpu": _cpu(),
        "native_cpu_kernels": _native(),
        "plugins": _plugins(plugins_spec),
    }


def _lines(data: dict, indent: str = "") -> list[str]:
    out = []
    for key, value in data.items():
        if isinstance(value, dict):
            out.append(f"{indent}{key}:")
            out += _lines(value, indent + "  ") if value else [f"{indent}  none"]
        else:
            out.append(f"{indent}{key}: {', '.join(value) if isinstance(value, list) else value}")
    return out


def run(args: argparse.Namespace) -> int:
    data = report(args.plugins)
    print(json.dumps(data, indent=2) if args.json else "\n".join(_lines(data)))
    return 0
