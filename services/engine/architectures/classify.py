"""Sequence classifiers: `LlamaForSequenceClassification` and its Mistral / Qwen2 / Qwen3 kin, the
decoder with a `score` head [num_labels, hidden] in place of the LM head. They serve /classify
through the pooling runner (kvrelay.engine.pooling): the head's logits at the prompt's last token,
as a softmax over the labels (a sigmoid for one label).

The head takes the LM head's place in the weights, so the decoder computes the label logits where
it would compute the vocabulary's; nothing else changes.
"""

from __future__ import annotations

import dataclasses

from kvrelay.engine.architectures import llama
from kvrelay.engine.architectures.base import Architecture
from kvrelay.engine.errors import ModelLoadError


def _num_labels(raw: dict, source: str) -> int:
    labels = raw.get("id2label")
    n = len(labels) if isinstance(labels, dict) and labels else raw.get("num_labels", 2)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ModelLoadError(f"{source}: num_labels must be a positive integer, got {n!r}")
    return n


def labels(raw: dict) -> tuple[str, ...]:
    """The label names by index (config.json's id2label; LABEL_i where it has none)."""
    names = raw.get("id2label") if isinstance(raw.get("id2label"), dict) else {}
    return tuple(str(names.get(str(i), names.get(i, f"LABEL_{i}"))) for i in range(_num_labels(raw, "config.json")))


def sequence_classifier(base: Architecture, name: str) -> Architecture:
    def parse(raw: dict, source: str, arch: str):
        config = base.parse_config(raw, source, arch)
        return dataclasses.replace(config, num_labels=_num_labels(raw, source), tie_word_embeddings=False)

    def shapes(config):
        out = base.expected_shapes(config)
        del out["lm_head.weight"]
        out["score.weight"] = (config.num_labels, config.hidden_size)
        return out

    def assemble(config, t):
        return base.assemble(config, {**t, "lm_head.weight": t["score.weight"]})

    return Architecture(name=name, parse_config=parse, expected_shapes=shapes, assemble=assemble)


_BASES = {a.name: a for a in llama.ARCHITECTURES}
ARCHITECTURES = [sequence_classifier(_BASES[f"{family}ForCausalLM"], f"{family}ForSequenceClassification")
                 for family in ("Llama", "Mistral", "Qwen2", "Qwen3")]
