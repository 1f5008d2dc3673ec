"""Vision-language models (LLaVA, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Mistral 3): images in
chat prompts.

- config.py: what config.json says about images (the placeholder token, tokens per image).
- inputs.py: ImagePrompt (what the API side, kvrelay.gateway.images, sends), the images a sequence
  carries in the engine, and a step's image rows.
- encoder.py: LLaVA's vision tower and projector (LLaVA-NeXT's on tiles, anyres.py);
  pixtral_vision.py: Mistral 3's; qwen_vision.py: the Qwen-VL vision transformers. Each runs on a
  step's new images at the first chunk that reaches them.
- mrope.py: Qwen2-VL's multimodal rotary positions (time, height, width per image feature).

The decoder runs as the text model it is; a prefill chunk's placeholder rows take the image
features in place of the token embedding (StepBatch.images), as transformers' masked scatter
does. For the prefix cache's block keys each placeholder stands for its image (inputs.cache_keys):
blocks are shared only where the images are the same, and blocks before an image with any prompt.
"""

from __future__ import annotations

from pathlib import Path

import torch
from kvrelay.engine.multimodal.config import VisionConfig, read_vision_config
from kvrelay.engine.multimodal.encoder import VisionEncoder

__all__ = ["VisionConfig", "VisionEncoder", "load_vision", "read_vision_config"]


def load_vision(args, model_dir: Path, config, dtype: torch.dtype, device: torch.device, *,
                parallel: bool, speculative: bool, pooling: bool):
    """The model's vision encoder; None for a text-only model. Raises ValueError for engine settings
    that do not run images yet (speculative: a draft model, which would need the images too)."""
    cfg = read_vision_config(model_dir)
    if cfg is None:
        return None
    refused = [(parallel, "tensor or pipeline parallelism (--tensor-parallel-size, --pipeline-parallel-size, --distributed-executor-backend mp)"),
               (speculative, "a draft model (--speculative-method draft; ngram works)"),
               (pooling, "--runner pooling"),
               (bool(getattr(args, "enable_lora", False)), "LoRA adapters (--enable-lora)")]
    for on, what in refused:
        if on:
            raise ValueError(f"{model_dir.name} is a vision-language model ({cfg.architecture}); {what} does not "
                             "run with images yet: drop it")
    if not 0 <= cfg.image_token_id < config.vocab_size:
        raise ValueError(f"{model_dir}: image_token_id {cfg.image_token_id} is outside the decoder's vocabulary "
                         f"({config.vocab_size})")
    dummy = args.load_format == "dummy"
    if cfg.qwen:
        from kvrelay.engine.multimodal.qwen_vision import QwenVisionEncoder

        return QwenVisionEncoder(cfg, model_dir, dtype, device, dummy)
    if cfg.pixtral:
        from kvrelay.engine.multimodal.pixtral_vision import PixtralEncoder

        return PixtralEncoder(cfg, model_dir, dtype, device, dummy)
    if cfg.anyres:
        from kvrelay.engine.multimodal.encoder import LlavaNextEncoder

        return LlavaNextEncoder(cfg, model_dir, dtype, device, dummy)
    return VisionEncoder(cfg, model_dir, dtype, device, dummy)
