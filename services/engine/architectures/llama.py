"""The Llama family: Llama, Mistral, Qwen2 and Qwen3 share one layout and differ only in a
default qkv bias (Qwen2), q/k RMSNorm (Qwen3) and sliding-window layers (Mistral, Qwen2).

Its checkpoint names and weight assembly are reused by families that extend the layout (Gemma).
"""

from __future__ import annotations

import functools

import torch
from kvrelay.engine.architectures.base import Architecture
from kvrelay.engine.model_config import ModelConfig, parse_decoder_config
from kvrelay.engine.weights import LayerWeights, Linear, ModelWeights


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for every tensor the decoder reads."""
    h, i, v, d = config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (config.q_size, h)
        shapes[p + "self_attn.k_proj.weight"] = (config.kv_size, h)
        shapes[p + "self_attn.v_proj.weight"] = (config.kv_size, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, config.q_size)
        if config.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (config.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (config.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (config.kv_size,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (i, h)
        shapes[p + "mlp.up_proj.weight"] = (i, h)
        shapes[p + "mlp.down_proj.weight"] = (h, i)
    return shapes


def assemble(config: ModelConfig, t: dict[str, torch.Tensor]) -> ModelWeights:
    layers = []
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        a = p + "self_attn."
        qkv_bias = None
        if config.qkv_bias:
            qkv_bias = torch.cat([t[a + "q_proj.bias"], t[a + "k_proj.bias"], t[a + "v_proj.bias"]])
        layers.append(
            LayerWeights(
                input_norm=t[p + "input_layernorm.weight"],
                qkv=Linear(
                    torch.cat([t[a + "q_proj.weight"], t[a + "k_proj.weight"], t[a + "v_proj.weight"]]),
                    qkv_bias,
                ),
                q_norm=t.get(a + "q_norm.weight"),
                k_norm=t.get(a + "k_norm.weight"),
                o_proj=Linear(t[a + "o_proj.weight"]),
                post_norm=t[p + "post_attention_layernorm.weight"],
                gate_up=Linear(torch.cat([t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]])),
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


def _llama(name: str, qkv_bias: bool = False, qk_norm: bool = False) -> Architecture:
    parse = functools.partial(parse_decoder_config, qkv_bias=qkv_bias, qk_norm=qk_norm)
    return Architecture(
        name=name,
        parse_config=lambda raw, source, arch: parse(raw, source, arch),
        expected_shapes=expected_shapes,
        assemble=assemble,
    )


ARCHITECTURES = [
    _llama("LlamaForCausalLM"),
    _llama("MistralForCausalLM"),
    _llama("Qwen2ForCausalLM", qkv_bias=True),
    _llama("Qwen3ForCausalLM", qk_norm=True),
    # The bare decoders (no LM head; checkpoint names without "model."): embedding models, served by
    # the pooling runner (kvrelay.engine.pooling), e.g. e5-mistral's MistralModel, gte-Qwen2's Qwen2Model.
    _llama("LlamaModel"),
    _llama("MistralModel"),
    _llama("Qwen2Model", qkv_bias=True),
    _llama("Qwen3Model", qk_norm=True),
]
