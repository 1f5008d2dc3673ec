"""Qwen2-MoE and Qwen3-MoE: the Qwen2 / Qwen3 layouts (qkv bias; q/k norms) with sparse MLP blocks
where `decoder_sparse_step` and `mlp_only_layers` put them, `moe_intermediate_size` experts,
softmax then top-k renormalised only with `norm_topk_prob`, and in Qwen2-MoE a shared expert
scaled by sigmoid(shared_expert_gate(x)) added to every token's output."""

from __future__ import annotations

import dataclasses

import torch
from kvrelay.engine.architectures import llama, moe
from kvrelay.engine.architectures.base import Architecture
from kvrelay.engine.model_config import ModelConfig, parse_decoder_config
from kvrelay.engine.moe_layer import MoEDecoderModel
from kvrelay.engine.weights import ModelWeights


def parse_config(raw: dict, source: str, arch: str) -> ModelConfig:
    qwen2 = arch == "Qwen2MoeForCausalLM"
    raw = dict(raw)
    if qwen2 and "attention_bias" not in raw:
        raw["attention_bias"] = raw.get("qkv_bias", True)  # transformers names it qkv_bias here
    config = parse_decoder_config(raw, source, arch, qkv_bias=qwen2, qk_norm=not qwen2)
    spec = moe.parse_moe(raw, source, arch, config.num_layers, norm_topk_prob=bool(raw.get("norm_topk_prob")),
                         sparse_step=True, shared=qwen2)
    return dataclasses.replace(config, moe=spec)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    return moe.expected_shapes(config, llama.expected_shapes)


def assemble(config: ModelConfig, t: dict[str, torch.Tensor]) -> ModelWeights:
    return moe.assemble(config, t, llama.assemble)


ARCHITECTURES = [
    Architecture(name, parse_config, expected_shapes, assemble, build_model=MoEDecoderModel)
    for name in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
]
