"""Gemma 2 and Gemma 3 (text): the Llama layout plus
- GeGLU: gelu (tanh approximation) instead of SiLU in the gated MLP;
- sandwich norms: a norm on the attention output, and norms before and after the MLP;
- RMSNorm weights stored as an offset from 1 (folded into the weight at load);
- embeddings scaled by sqrt(hidden_size), attention scaled by query_pre_attn_scalar ** -0.5;
- attention and final logit soft-capping (Gemma 2);
- interleaved sliding-window and global layers (`layer_types`), and in Gemma 3 q/k norms and
  a separate rope base for the sliding layers.
"""

from __future__ import annotations

import dataclasses

import torch
from kvrelay.engine.architectures import llama
from kvrelay.engine.architectures.base import Architecture
from kvrelay.engine.errors import ModelLoadError
from kvrelay.engine.model_config import ModelConfig, parse_decoder_config, parse_rope
from kvrelay.engine.weights import ModelWeights

GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
# Every `sliding_window_pattern`-th layer is global when config.json has no layer_types.
DEFAULT_PATTERN = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6}


def parse_config(raw: dict, source: str, arch: str) -> ModelConfig:
    raw = dict(raw)
    if raw.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: use_bidirectional_attention (an embedding model) is not supported")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in GELU_TANH:
        raise ModelLoadError(f"{source}: hidden_activation {act!r} unsupported for {arch}; supported: {GELU_TANH}")
    num_layers = int(raw.get("num_hidden_layers", 0))
    if not raw.get("layer_types") and raw.get("sliding_window"):
        pattern = int(raw.get("sliding_window_pattern") or DEFAULT_PATTERN[arch])
        raw["layer_types"] = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
        ]
    gemma3 = arch == "Gemma3ForCausalLM"
    local_theta = None
    rope = raw.get("rope_parameters")
    if gemma3:
        # transformers >= 5: one rope dict per layer type; older files: rope_scaling (global
        # layers), rope_theta and rope_local_base_freq.
        if isinstance(rope, dict) and "full_attention" in rope:
            local = rope.get("sliding_attention") or {}
            raw["rope_parameters"] = rope["full_attention"] or {}
        else:
            local = {"rope_theta": raw.get("rope_local_base_freq", 10000.0)}
        local_type, local_theta, _ = parse_rope(local, {"rope_theta": 10000.0}, source)
        if local_type != "default":
            raise ModelLoadError(f"{source}: sliding layers' rope type {local_type!r} unsupported; supported: default")
    config = parse_decoder_config(raw, source, arch, qk_norm=gemma3)
    return dataclasses.replace(
        config,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        hidden_act="gelu_tanh",
        sandwich_norms=True,
        embed_scale=config.hidden_size**0.5,
        attn_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_softcap=raw.get("attn_logit_softcapping"),
        final_softcap=raw.get("final_logit_softcapping"),
        local_rope_theta=local_theta,
    )


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    shapes = llama.expected_shapes(config)
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        shapes[p + "pre_feedforward_layernorm.weight"] = (config.hidden_size,)
        shapes[p + "post_feedforward_layernorm.weight"] = (config.hidden_size,)
    return shapes


def _unit_offset(w: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm multiplies by (1 + weight), computed in fp32."""
    return (1.0 + w.float()).to(w.dtype)


def assemble(config: ModelConfig, t: dict[str, torch.Tensor]) -> ModelWeights:
    weights = llama.assemble(config, t)
    for n, layer in enumerate(weights.layers):
        p = f"model.layers.{n}."
        layer.input_norm = _unit_offset(layer.input_norm)
        layer.post_norm = _unit_offset(layer.post_norm)
        layer.pre_ffn_norm = _unit_offset(t[p + "pre_feedforward_layernorm.weight"])
        layer.post_ffn_norm = _unit_offset(t[p + "post_feedforward_layernorm.weight"])
        if config.qk_norm:
            layer.q_norm, layer.k_norm = _unit_offset(layer.q_norm), _unit_offset(layer.k_norm)
    weights.norm = _unit_offset(weights.norm)
    return weights


ARCHITECTURES = [
    Architecture(name, parse_config, expected_shapes, assemble, zero_norms=True)
    for name in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
]
