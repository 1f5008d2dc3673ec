"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL: a vision transformer whose merger emits a variable number of
features per image (by its size), in front of a Qwen2 (Qwen3-VL: Qwen3) decoder with multimodal
rotary positions (M-RoPE; Qwen3-VL interleaves its sections and adds "deepstack" features of the
tower's middle layers to the first decoder layers' outputs at the image rows).

As with LLaVA (llava.py), the decoder is its text architecture (Qwen2 or Qwen3): this entry reads the text
fields (`text_config`, or the top level in the hub's files) and returns the decoder's ModelConfig
with `mrope_section` set; the decoder's tensors sit under "model." or "model.language_model.". The
vision half and the positions are kvrelay.engine.multimodal's.
"""

from __future__ import annotations

import dataclasses

from kvrelay.engine.architectures.base import vision_language
from kvrelay.engine.errors import ModelLoadError
from kvrelay.engine.model_config import ModelConfig


def parse(raw: dict, source: str, arch: str) -> ModelConfig:
    from kvrelay.engine.architectures import get

    text = dict(raw.get("text_config") or raw)
    text.setdefault("torch_dtype", raw.get("torch_dtype") or raw.get("dtype"))
    key = "rope_parameters" if "rope_parameters" in text else "rope_scaling"
    rope = dict(text.get(key) or {})
    section = rope.pop("mrope_section", None)
    interleaved = bool(rope.pop("mrope_interleaved", False))
    if not section:
        raise ModelLoadError(f"{source}: {arch} needs rope_parameters.mrope_section (M-RoPE)")
    if rope.get("rope_type", rope.get("type")) in ("mrope", "default", None):
        rope.pop("type", None)
        rope["rope_type"] = "default"
    text[key] = rope
    inner = get(TEXT[arch])
    config = inner.parse_config(text, f"{source} (text)", inner.name)
    if 2 * sum(section) != config.head_dim:
        raise ModelLoadError(f"{source}: mrope_section {section} must sum to head_dim / 2 = {config.head_dim // 2}")
    return dataclasses.replace(config, mrope_section=tuple(int(s) for s in section), mrope_interleaved=interleaved)


TEXT = {  # architecture -> its decoder's
    "Qwen2VLForConditionalGeneration": "Qwen2ForCausalLM",
    "Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",
    "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM",
}

ARCHITECTURES = [vision_language(name, parse) for name in TEXT]
