"""Load a decoder's weights from safetensors (single or sharded), or make random ones (dummy)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from kvrelay.engine.errors import ModelLoadError
from kvrelay.engine.model_config import ModelConfig
from kvrelay.kernels.reference import PackedWeight
from safetensors import safe_open


@dataclass
class Linear:
    """A linear layer's weight [out, in] and optional bias; int8 weights carry per-row scales.
    Where the kernels pack weights (kvrelay.kernels.native_ops.prepack_linear), packed replaces
    weight, which is then None."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None = None
    scale: torch.Tensor | None = None  # set when weight is int8 or float8_e4m3fn
    packed: PackedWeight | None = None
    all_reduce: bool = False  # row-parallel (tensor parallel): the output is a partial sum over ranks
    lora: Any = None  # the served LoRA adapters' stacks for this projection (kvrelay.engine.lora.stacked)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Linear  # q, k, v fused along the output dim
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_proj: Linear
    post_norm: torch.Tensor
    gate_up: Linear | None  # gate and up fused along the output dim (None in an MoE layer)
    down: Linear | None
    # Sandwich norms (Gemma): post_norm then normalises the attention output, and these two
    # surround the MLP. None for the Llama layout, where post_norm precedes the MLP.
    pre_ffn_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None
    # A mixture-of-experts layer's router, experts and shared expert
    # (kvrelay.engine.architectures.moe.MoEWeights), in place of gate_up and down.
    moe: Any = None

    def linears(self) -> list[Linear]:
        """Every dense projection of the layer (the MoE layer's shared expert included)."""
        extra = self.moe.linears() if self.moe is not None else []
        return [lin for lin in (self.qkv, self.o_proj, self.gate_up, self.down, *extra) if lin is not None]


@dataclass
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: torch.Tensor | None  # the embedding itself when tied; None once packed (untied)
    lm_head_packed: PackedWeight | None = None


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for every tensor the decoder reads (as the architecture names them)."""
    from kvrelay.engine.architectures import get

    return get(config.architecture).expected_shapes(config)


def shard_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name -> file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index (needs a 'weight_map'): {e}") from e
        files = {name: model_dir / fname for name, fname in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise ModelLoadError(f"{f}: missing; it is listed in {index.name}")
        return files
    singles = sorted(model_dir.glob("*.safetensors"))
    if not singles:
        raise ModelLoadError(f"{model_dir}: no *.safetensors file and no model.safetensors.index.json")
    files: dict[str, Path] = {}
    for f in singles:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():  # noqa: SIM118 - safe_open is not iterable
                files[name] = f
    return files


def stored_name_candidates(name: str) -> tuple[str, ...]:
    """Where a checkpoint may keep the decoder tensor `name` (as the Llama layout names it): as is;
    without "model." (a bare decoder: LlamaModel, Qwen2Model embedding models); or inside a
    vision-language model (LlavaForConditionalGeneration) as "language_model.<name>" (the layout
    transformers saves) or "model.language_model.<rest>" (the layout it runs)."""
    rest = name[len("model."):] if name.startswith("model.") else None
    out = [name]
    if rest is not None:
        out += [rest, "model.language_model." + rest]
    out.append("language_model." + name)
    return tuple(out)


def checkpoint_files(model_dir: Path, names) -> tuple[dict[str, Path], dict[str, str]]:
    """(name -> file holding it, name -> the name stored there) for the names an architecture reads
    (stored_name_candidates: the first found wins). Names found nowhere are left out."""
    files = shard_files(model_dir)
    stored = {n: next((c for c in stored_name_candidates(n) if c in files), n) for n in names}
    return {n: files[s] for n, s in stored.items() if s in files}, stored


def read_tensors(model_dir: Path, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    shapes = expected_shapes(config)
    files, stored = checkpoint_files(model_dir, shapes)
    missing = [n for n in shapes if n not in files]
    if missing:
        where = ", ".join(sorted({files_path.name for files_path in files.values()})) or "no file"
        raise ModelLoadError(
            f"{model_dir}: tensor {missing[0]!r} (expected shape {list(shapes[missing[0]])}) is missing "
            f"from {where}" + (f" ({len(missing) - 1} more missing)" if len(missing) > 1 else "")
        )
    by_file: dict[Path, list[str]] = {}
    for name in shapes:
        by_file.setdefault(files[name], []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    total_bytes = sum(f.stat().st_size for f in by_file)
    show_progress = total_bytes > 512 * 2**20
    started, done_bytes = time.monotonic(), 0
    for k, (path, names) in enumerate(sorted(by_file.items())):
        with safe_open(str(path), framework="pt") as st:
            for name in names:
                shape = tuple(st.get_slice(stored[name]).get_shape())
                if shape != shapes[name]:
                    raise ModelLoadError(
                        f"{path.name}: tensor {name!r} has shape {list(shape)}, expected {list(shapes[name])} "
                        f"from config.json"
                    )
                tensors[name] = st.get_tensor(stored[name]).to(dtype)
        done_bytes += path.stat().st_size
        if show_progress:
            print(
                f"loading weights: shard {k + 1}/{len(by_file)} {done_bytes / 2**30:.1f}/{total_bytes / 2**30:.1f} GiB "
                f"({time.monotonic() - started:.1f}s)",
                file=sys.stderr,
                flush=True,
            )
    return tensors


def dummy_tensors(config: ModelConfig, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights at the config's shapes (for benchmarks at real sizes)."""
    from kvrelay.engine.architectures import get

    gen = torch.Generator().manual_seed(seed)
    # Norm weights stored as an offset from 1 (Gemma) are zero for a unit norm.
    unit_norm = torch.zeros if get(config.architecture).zero_norms else torch.ones
    out = {}
    for name, shape in expected_shapes(config).items():
        if name.endswith(("norm.weight", "layernorm.weight")):
            out[name] = unit_norm(shape, dtype=dtype)
        elif name.endswith(".bias"):
            out[name] = torch.zeros(shape, dtype=dtype)
        else:
            out[name] = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
    return out


def assemble(config: ModelConfig, t: dict[str, torch.Tensor]) -> ModelWeights:
    """The decoder's weights from the checkpoint's tensors, as the architecture maps them."""
    from kvrelay.engine.architectures import get

    return get(config.architecture).assemble(config, t)


def quantize_linears(weights: ModelWeights, quantize) -> None:
    """Replace every projection inside the decoder layers with quantized (int8 or fp8) weights +
    per-row scales; quantize is the kernel op (quantize_int8 or quantize_fp8)."""
    for layer in weights.layers:
        for lin in layer.linears():
            lin.weight, lin.scale = quantize(lin.weight)
        if layer.moe is not None:
            layer.moe.quantize_experts(quantize)


def pack_linears(weights: ModelWeights, prepack_linear) -> None:
    """Give every fp32 projection and the LM head the kernels' packed layout where they have one
    (prepack_linear returns None where not), dropping the unpacked copy. A tied LM head is packed
    as a copy: the embedding stays for lookups."""
    for layer in weights.layers:
        for lin in layer.linears():
            if lin.scale is None and (packed := prepack_linear(lin.weight)) is not None:
                lin.weight, lin.packed = None, packed
    if (packed := prepack_linear(weights.lm_head)) is not None:
        tied = weights.lm_head is weights.embed
        weights.lm_head_packed, weights.lm_head = packed, weights.lm_head if tied else None
