"""The parts of a Hugging Face config.json the decoder needs, validated with clear errors."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from kvrelay.engine.errors import ModelLoadError

# Architecture -> (qkv bias by default, q/k RMSNorm).
ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}
ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_type: str
    rope_params: dict
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None
    torch_dtype: str | None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def load_model_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{path}: missing; a Hugging Face model folder needs config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from e
    return model_config_from_dict(raw, source=str(path))


def model_config_from_dict(raw: dict, source: str = "config.json") -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"{source}: unsupported architecture {archs!r}; supported: {', '.join(ARCHITECTURES)}"
        )

    def need(key: str):
        if key not in raw:
            raise ModelLoadError(f"{source}: missing required field {key!r} for {arch}")
        return raw[key]

    hidden = int(need("hidden_size"))
    num_heads = int(need("num_attention_heads"))
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    if num_heads % num_kv_heads:
        raise ModelLoadError(
            f"{source}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
        )
    if head_dim % 2:
        raise ModelLoadError(f"{source}: head_dim {head_dim} must be even for rotary embeddings")

    # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older files `rope_scaling`.
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    if rope_type in ("linear", "llama3") and not (
        isinstance(rope.get("factor"), (int, float)) and rope["factor"] > 0
    ):
        raise ModelLoadError(
            f"{source}: rope type {rope_type!r} needs a positive 'factor', got {rope.get('factor')!r}"
        )

    default_bias, qk_norm = ARCHITECTURES[arch]
    sliding = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    return ModelConfig(
        architecture=arch,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_type=rope_type,
        rope_params=rope,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("attention_bias", default_bias)),
        qk_norm=qk_norm,
        sliding_window=int(sliding) if sliding else None,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
    )


def rope_cos_sin_cache(config: ModelConfig, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] fp32: cos in the first half, sin in the second (rope scaling baked in)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    params = config.rope_params
    if config.rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif config.rope_type == "llama3":
        factor = float(params["factor"])
        low = float(params.get("low_freq_factor", 1.0))
        high = float(params.get("high_freq_factor", 4.0))
        old_len = float(params.get("original_max_position_embeddings", config.max_position_embeddings))
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.int64).float(), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)
