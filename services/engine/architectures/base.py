"""What an architecture module provides: how to read its config.json, which checkpoint tensors
it needs, how they become the decoder's weights, and the model class that runs them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from kvrelay.engine.model_config import ModelConfig
from kvrelay.engine.weights import ModelWeights

# fn(raw config dict, source for messages, architecture name) -> ModelConfig
ParseConfig = Callable[[dict, str, str], ModelConfig]


@dataclass(frozen=True)
class Architecture:
    """One entry of the registry, keyed by the name in config.json's `architectures` list.

    build_model(config, weights, ops, max_positions) returns an object whose
    forward(batch: StepBatch, kv_cache) -> fp32 logits [S, vocab] runs one engine step (the
    shared kvrelay.engine.model.DecoderModel unless the family needs its own).
    """

    name: str
    parse_config: ParseConfig
    expected_shapes: Callable[[ModelConfig], dict[str, tuple[int, ...]]]
    assemble: Callable[[ModelConfig, dict[str, torch.Tensor]], ModelWeights]
    build_model: Callable[..., Any] | None = None  # None: DecoderModel
    # Checkpoint tensors whose random stand-in (--load-format dummy) is zero, not one (norm
    # weights stored as an offset from 1, as Gemma's are). Names end with one of these.
    zero_norms: bool = False


def vision_language(name: str, parse_config: ParseConfig) -> Architecture:
    """A vision-language model's entry: parse_config returns its text decoder's ModelConfig (naming
    the text architecture), so the decoder's shapes and weights are that architecture's; the vision
    half is kvrelay.engine.multimodal's."""

    def delegate(attr: str):
        def call(config: ModelConfig, *args):
            from kvrelay.engine.architectures import get

            return getattr(get(config.architecture), attr)(config, *args)

        return call

    return Architecture(name=name, parse_config=parse_config, expected_shapes=delegate("expected_shapes"),
                        assemble=delegate("assemble"))
