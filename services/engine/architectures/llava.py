"""LLaVA (LlavaForConditionalGeneration, LlavaNextForConditionalGeneration) and Mistral 3
(Mistral3ForConditionalGeneration): a vision tower and a projector in front of a Llama-family
decoder. The decoder is exactly the text model's architecture: this entry reads `text_config` and
returns the text architecture's ModelConfig, so the decoder loads, runs and is checked as that
model does (its tensors sit under "language_model.", weights.stored_name_candidates). The vision
half lives in kvrelay.engine.multimodal, which reads the rest of config.json.
"""

from __future__ import annotations

from kvrelay.engine.architectures.base import vision_language
from kvrelay.engine.errors import ModelLoadError
from kvrelay.engine.model_config import ModelConfig

# text_config's model_type -> the decoder architecture that runs it
TEXT_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def text_config(raw: dict, source: str) -> dict:
    """config.json's text_config with transformers' defaults filled in: LLaVA checkpoints often
    store only the fields that differ from them (llava-1.5's keeps no hidden_size)."""
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(f"{source}: a LLaVA config needs a `text_config` object")
    model_type = text.get("model_type", "llama")
    if model_type not in TEXT_ARCHITECTURES:
        raise ModelLoadError(f"{source}: text_config.model_type {model_type!r} is not supported under LLaVA; "
                             f"supported: {', '.join(TEXT_ARCHITECTURES)}")
    from transformers import CONFIG_MAPPING

    full = CONFIG_MAPPING[model_type](**text).to_dict()
    # A LLaVA file's dtype sits at the top level.
    full["torch_dtype"] = raw.get("torch_dtype") or raw.get("dtype") or full.get("torch_dtype") or full.get("dtype")
    return full


def parse(raw: dict, source: str, arch: str) -> ModelConfig:
    from kvrelay.engine.architectures import get

    text = text_config(raw, source)
    inner = get(TEXT_ARCHITECTURES[text["model_type"]])
    return inner.parse_config(text, f"{source} (text_config)", inner.name)


# LLaVA-NeXT: LLaVA's tower on tiles of the image. Mistral 3 (Mistral Small 3.1 and later): a Pixtral
# tower before the same layout of a Mistral decoder.
ARCHITECTURES = [vision_language(name, parse)
                 for name in ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
                              "Mistral3ForConditionalGeneration")]
