"""Mixtral: the Mistral layout with every MLP a sparse block (`block_sparse_moe`) of
`num_local_experts` experts (w1 gate, w3 up, w2 down), softmax then top-k, renormalised."""

from __future__ import annotations

import dataclasses

import torch
from kvrelay.engine.architectures import llama, moe
from kvrelay.engine.architectures.base import Architecture
from kvrelay.engine.model_config import ModelConfig, parse_decoder_config
from kvrelay.engine.moe_layer import MoEDecoderModel
from kvrelay.engine.weights import ModelWeights


def parse_config(raw: dict, source: str, arch: str) -> ModelConfig:
    config = parse_decoder_config(raw, source, arch)
    spec = moe.parse_moe(raw, source, arch, config.num_layers, norm_topk_prob=True, sparse_step=False,
                         block="block_sparse_moe", expert_names=("w1", "w3", "w2"))
    return dataclasses.replace(config, moe=spec)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    return moe.expected_shapes(config, llama.expected_shapes)


def assemble(config: ModelConfig, t: dict[str, torch.Tensor]) -> ModelWeights:
    return moe.assemble(config, t, llama.assemble)


ARCHITECTURES = [Architecture("MixtralForCausalLM", parse_config, expected_shapes, assemble,
                              build_model=MoEDecoderModel)]
