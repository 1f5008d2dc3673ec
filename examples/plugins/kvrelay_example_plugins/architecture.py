"""ExampleLlamaForCausalLM: a Llama whose input embeddings are multiplied by the config's
`embedding_multiplier` (as some Llama derivatives do). It reuses the Llama family's checkpoint
names and weights, and sets one field of the decoder's recipe."""

from __future__ import annotations

import dataclasses

from kvrelay.engine.architectures import llama
from kvrelay.engine.architectures.base import Architecture
from kvrelay.engine.errors import ModelLoadError
from kvrelay.engine.model_config import parse_decoder_config


def parse_config(raw: dict, source: str, arch: str):
    multiplier = raw.get("embedding_multiplier", 1.0)
    if not isinstance(multiplier, (int, float)) or multiplier <= 0:
        raise ModelLoadError(f"{source}: embedding_multiplier must be a positive number, got {multiplier!r}")
    return dataclasses.replace(parse_decoder_config(raw, source, arch), embed_scale=float(multiplier))


ARCHITECTURE = Architecture("ExampleLlamaForCausalLM", parse_config, llama.expected_shapes, llama.assemble)
