"""Phi-3: the Llama layout with q/k/v fused into one `qkv_proj` and gate/up into one
`gate_up_proj` in the checkpoint, a sliding window on every layer where configured, and
longrope scaling (short factors within the original context, long factors past it)."""

from __future__ import annotations

import dataclasses

import torch
from kvrelay.engine.architectures.base import Architecture
from kvrelay.engine.errors import ModelLoadError
from kvrelay.engine.model_config import ModelConfig, parse_decoder_config
from kvrelay.engine.weights import LayerWeights, Linear, ModelWeights


def parse_config(raw: dict, source: str, arch: str) -> ModelConfig:
    raw = dict(raw)
    rope_key = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    rope = dict(raw.get(rope_key) or {})
    if (rope.get("rope_type") or rope.get("type")) in ("su", "yarn"):  # Phi-3's early names for longrope
        rope["rope_type"] = "longrope"
        rope.pop("type", None)
        raw[rope_key] = rope
    partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ModelLoadError(f"{source}: partial_rotary_factor {partial} unsupported for {arch}; supported: 1.0")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{source}: hidden_act {act!r} unsupported for {arch}; supported: silu")
    return dataclasses.replace(parse_decoder_config(raw, source, arch), qkv_bias=False)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.qkv_proj.weight"] = (config.q_size + 2 * config.kv_size, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, config.q_size)
        shapes[p + "mlp.gate_up_proj.weight"] = (2 * i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    return shapes


def assemble(config: ModelConfig, t: dict[str, torch.Tensor]) -> ModelWeights:
    layers = []
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        layers.append(
            LayerWeights(
                input_norm=t[p + "input_layernorm.weight"],
                qkv=Linear(t[p + "self_attn.qkv_proj.weight"]),  # already [q; k; v]
                q_norm=None,
                k_norm=None,
                o_proj=Linear(t[p + "self_attn.o_proj.weight"]),
                post_norm=t[p + "post_attention_layernorm.weight"],
                gate_up=Linear(t[p + "mlp.gate_up_proj.weight"]),  # already [gate; up]
                down=Linear(t[p + "mlp.down_proj.weight"]),
            )
        )
    embed = t["model.embed_tokens.weight"]
    return ModelWeights(
        embed=embed,
        layers=layers,
        norm=t["model.norm.weight"],
        lm_head=embed if config.tie_word_embeddings else t["lm_head.weight"],
    )


ARCHITECTURES = [Architecture("Phi3ForCausalLM", parse_config, expected_shapes, assemble)]
