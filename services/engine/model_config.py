"""The parts of a Hugging Face config.json the decoder needs, validated with clear errors.

Which fields an architecture reads, and how it maps them onto the decoder's building blocks, is
the architecture module's business (kvrelay.engine.architectures); this module holds the
config they all produce, the fields every decoder shares, and the rotary tables.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from kvrelay.engine.errors import ModelLoadError
from kvrelay.engine.rope import ROPE_TYPES, check_rope_params, context_limit, rope_cos_sin_table

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ACTIVATIONS = ("silu", "gelu_tanh")


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
    # The layer recipe beyond the Llama family; every default is Llama's.
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_tanh" (GeGLU)
    sandwich_norms: bool = False  # Gemma: a norm after attention, and norms before and after the MLP
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the softmax
    final_softcap: float | None = None  # the same on the logits
    # Per layer: its sliding window (None: full attention). Empty: sliding_window on every layer.
    layer_windows: tuple[int | None, ...] = ()
    local_rope_theta: float | None = None  # Gemma 3: sliding layers use default rope with this base
    # Mixture of experts (kvrelay.engine.architectures.moe.MoEConfig); None for a dense model.
    moe: Any = None
    # Sequence classifiers (architectures/classify.py): the head's labels; 0 for every other model.
    num_labels: int = 0
    # Qwen2-VL's multimodal rotary (M-RoPE): how many frequencies take each of the (time, height, width)
    # positions (kvrelay.engine.multimodal.mrope); None: one position per token.
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False  # Qwen3-VL: the sections' frequencies interleave (t, h, w, t, h, w, ...)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window, None for a full-attention layer."""
        return self.layer_windows or (self.sliding_window,) * self.num_layers

    @property
    def max_context(self) -> int:
        """The longest context the model supports, rope scaling included."""
        return context_limit(self.rope_type, self.rope_params, self.max_position_embeddings)


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
    """The config of whichever registered architecture the file names (see kvrelay.engine.architectures)."""
    from kvrelay.engine.architectures import lookup

    arch = lookup(raw.get("architectures") or [], source)
    return arch.parse_config(raw, source, arch.name)


def _need(raw: dict, key: str, source: str, arch: str):
    if key not in raw:
        raise ModelLoadError(f"{source}: missing required field {key!r} for {arch}")
    return raw[key]


def layer_windows(raw: dict, num_layers: int, source: str) -> tuple[tuple[int | None, ...], int | None]:
    """(per-layer windows, the window size) from `sliding_window`, `use_sliding_window` and the
    `layer_types` list transformers >= 4.53 writes ("sliding_attention" / "full_attention")."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
    window = int(window) if window else None
    types = raw.get("layer_types")
    if window is None or not types:
        return (window,) * num_layers, window
    if len(types) != num_layers:
        raise ModelLoadError(f"{source}: layer_types lists {len(types)} layers, num_hidden_layers is {num_layers}")
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ModelLoadError(
            f"{source}: layer_types {unknown} unsupported; supported: sliding_attention, full_attention"
        )
    return tuple(window if t == "sliding_attention" else None for t in types), window


def parse_rope(rope: dict, raw: dict, source: str) -> tuple[str, float, dict]:
    """(rope type, theta, parameters) from a `rope_parameters` / `rope_scaling` dict, validated."""
    rope = dict(rope)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}"
        )
    theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    # Some configs keep original_max_position_embeddings at the top level (Phi-3).
    if "original_max_position_embeddings" not in rope and raw.get("original_max_position_embeddings"):
        rope["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
    problem = check_rope_params(rope_type, rope)
    if problem:
        raise ModelLoadError(f"{source}: rope type {rope_type!r} {problem}")
    return rope_type, theta, rope


def parse_decoder_config(
    raw: dict, source: str, arch: str, *, qkv_bias: bool = False, qk_norm: bool = False
) -> ModelConfig:
    """The fields every decoder shares, read the Llama way; architectures adjust the result with
    dataclasses.replace. qkv_bias: the default when the file has no `attention_bias`."""

    def need(key: str):
        return _need(raw, key, source, arch)

    hidden = int(need("hidden_size"))
    num_heads = int(need("num_attention_heads"))
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    num_layers = int(need("num_hidden_layers"))
    if num_heads % num_kv_heads:
        raise ModelLoadError(
            f"{source}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
        )
    if head_dim % 2:
        raise ModelLoadError(f"{source}: head_dim {head_dim} must be even for rotary embeddings")

    # transformers >= 5 writes `rope_parameters` (with rope_theta inside); older files `rope_scaling`.
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type, rope_theta, rope = parse_rope(rope, raw, source)
    windows, window = layer_windows(raw, num_layers, source)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_type=rope_type,
        rope_params=rope,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=bool(raw.get("attention_bias", qkv_bias)),
        qk_norm=qk_norm,
        sliding_window=window,
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        layer_windows=windows if any(w != window for w in windows) else (),
    )


def rope_cos_sin_cache(config: ModelConfig, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim] fp32: cos in the first half, sin in the second (rope scaling and
    its attention factor baked in), for the model's full-attention layers."""
    return rope_cos_sin_table(
        config.rope_type, config.rope_params, config.rope_theta, config.head_dim,
        config.max_position_embeddings, max_positions,
    )
