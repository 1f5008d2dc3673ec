"""Reading a LoRA adapter as PEFT saves it (adapter_config.json, adapter_model.safetensors) and
checking it against the base model, so a wrong adapter fails at start-up with the file and tensor.

The delta of each target module is B @ A scaled by lora_alpha / r (lora_alpha / sqrt(r) with
use_rslora); the scale is folded into B here, once.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from kvrelay.engine.errors import ModelLoadError
from kvrelay.engine.model_config import ModelConfig
from safetensors import safe_open

# PEFT's module names, as the engine fuses them: module -> (fused linear, part). The fused q/k/v
# output is [q | k | v], gate/up is [gate | up]; Phi-3 checkpoints (and their adapters) are fused already.
MODULES = {
    "q_proj": ("qkv", "q"), "k_proj": ("qkv", "k"), "v_proj": ("qkv", "v"), "qkv_proj": ("qkv", "qkv"),
    "o_proj": ("o_proj", "all"),
    "gate_proj": ("gate_up", "gate"), "up_proj": ("gate_up", "up"), "gate_up_proj": ("gate_up", "gate_up"),
    "down_proj": ("down", "all"),
}
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoRAModule:
    """One target module of one layer: A [r, in], B [out, r] with the scale folded in."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass
class LoRAAdapter:
    name: str
    path: Path
    rank: int
    # (layer, PEFT module name) -> its weights
    modules: dict[tuple[int, str], LoRAModule] = field(default_factory=dict)


def parse_lora_modules(specs: list[str] | tuple[str, ...]) -> dict[str, Path]:
    """vLLM's `--lora-modules NAME=PATH ...` (or a JSON object with name and path) as {name: path}."""
    out: dict[str, Path] = {}
    for spec in specs:
        if spec.lstrip().startswith("{"):
            try:
                obj = json.loads(spec)
                name, path = obj["name"], obj["path"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-modules {spec!r}: a JSON entry needs \"name\" and \"path\" ({e})") from e
        else:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {spec!r}: expected NAME=PATH")
        if name in out:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        out[str(name)] = Path(path)
    return out


def _read_config(path: Path) -> dict:
    cfg_path = path / "adapter_config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{path}: not a PEFT LoRA adapter folder (no adapter_config.json)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_path}: not valid JSON ({e})") from e
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ModelLoadError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r}; only LORA adapters are served")
    unsupported = {
        "use_dora": "DoRA", "modules_to_save": "modules_to_save (whole copied modules)",
        "rank_pattern": "rank_pattern", "alpha_pattern": "alpha_pattern",
    }
    for key, what in unsupported.items():
        if cfg.get(key):
            raise ModelLoadError(f"{cfg_path}: {what} is not supported; train the adapter without it")
    if cfg.get("bias", "none") != "none":
        raise ModelLoadError(f"{cfg_path}: bias {cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("fan_in_fan_out"):
        raise ModelLoadError(f"{cfg_path}: fan_in_fan_out (GPT-2 Conv1D layers) is not supported")
    return cfg


def load_adapter(name: str, path: Path | str, config: ModelConfig, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Read and check one adapter against the base model's config (its layers and projection shapes)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"{path}: LoRA adapter folder not found")
    cfg = _read_config(path)
    rank, alpha = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", 8))
    if not 1 <= rank <= max_rank:
        raise ModelLoadError(f"{path}: rank r={rank} exceeds --max-lora-rank {max_rank}; raise it")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    weights_path = path / "adapter_model.safetensors"
    if not weights_path.is_file():
        raise ModelLoadError(f"{path}: adapter_model.safetensors not found (save the adapter with safetensors)")
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_path), framework="pt") as f:
        names = f.keys()  # a safe_open handle is not iterable
        for key in names:
            m = _KEY.match(key)
            if m is None:
                raise ModelLoadError(f"{weights_path}: tensor {key!r} is not a LoRA weight of a decoder "
                                     f"projection ({', '.join(MODULES)}); embeddings and the LM head are not supported")
            layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
            if module not in MODULES:
                raise ModelLoadError(f"{weights_path}: {key!r}: module {module!r} is not one of {', '.join(MODULES)}")
            if layer >= config.num_layers:
                raise ModelLoadError(f"{weights_path}: {key!r}: the model has {config.num_layers} layers")
            parts.setdefault((layer, module), {})[ab] = f.get_tensor(key)
    if not parts:
        raise ModelLoadError(f"{weights_path}: holds no LoRA weights")
    adapter = LoRAAdapter(name, path, rank)
    for (layer, module), ab in sorted(parts.items()):
        where = f"{weights_path}: layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            raise ModelLoadError(f"{where}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]
        out_dim, in_dim = module_shape(config, module)
        if tuple(a.shape) != (rank, in_dim) or tuple(b.shape) != (out_dim, rank):
            raise ModelLoadError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, expected "
                                 f"{(rank, in_dim)} and {(out_dim, rank)} for r={rank} on this model")
        adapter.modules[(layer, module)] = LoRAModule(a.to(dtype), (b.float() * scale).to(dtype))
    return adapter


def module_shape(config: ModelConfig, module: str) -> tuple[int, int]:
    """(out, in) of a PEFT target module in the base model."""
    h, i = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (config.q_size, h), "k_proj": (config.kv_size, h), "v_proj": (config.kv_size, h),
        "qkv_proj": (config.q_size + 2 * config.kv_size, h), "o_proj": (h, config.q_size),
        "gate_proj": (i, h), "up_proj": (i, h), "gate_up_proj": (2 * i, h), "down_proj": (h, i),
    }[module]
