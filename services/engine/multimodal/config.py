"""What a vision-language model's config.json says about its images: which token stands for an
image, how many of them one image becomes, and how its vision tower's features are read."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvrelay.engine.errors import ModelLoadError

VISION_LANGUAGE_ARCHITECTURES = ("LlavaForConditionalGeneration",)
# Vision towers with a fixed image size (one image, one run of placeholder tokens); the class token
# they prepend, if any.
VISION_TOWERS = {"clip_vision_model": 1, "siglip_vision_model": 0}


@dataclass(frozen=True)
class VisionConfig:
    architecture: str
    image_token_id: int
    tokens_per_image: int  # placeholder tokens of one image in the prompt (its projected features)
    feature_layers: tuple[int, ...]  # hidden states read (concatenated when several)
    drop_class_token: bool  # vision_feature_select_strategy "default": the first feature is dropped
    projector_act: str
    image_size: int
    vision: dict  # config.json's vision_config, for the tower's own config class

    @property
    def pixel_shape(self) -> tuple[int, int, int]:
        return (int(self.vision.get("num_channels", 3)), self.image_size, self.image_size)


def read_vision_config(model_dir: Path) -> VisionConfig | None:
    """The model's VisionConfig; None for a text-only model."""
    path = Path(model_dir) / "config.json"
    raw = json.loads(path.read_text())
    arch = next((a for a in raw.get("architectures") or [] if a in VISION_LANGUAGE_ARCHITECTURES), None)
    if arch is None:
        return None
    vision = raw.get("vision_config") or {}
    tower = vision.get("model_type", "clip_vision_model")
    if tower not in VISION_TOWERS:
        raise ModelLoadError(f"{path}: vision_config.model_type {tower!r} is not supported; supported: "
                             f"{', '.join(VISION_TOWERS)} (fixed-size image towers)")
    strategy = raw.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ModelLoadError(f"{path}: vision_feature_select_strategy {strategy!r} must be 'default' or 'full'")
    layers = raw.get("vision_feature_layer", -2)
    layers = (layers,) if isinstance(layers, int) else tuple(layers)
    token = raw.get("image_token_id", raw.get("image_token_index"))
    if not isinstance(token, int):
        raise ModelLoadError(f"{path}: a vision-language config needs image_token_id (or image_token_index)")
    image_size, patch = int(vision.get("image_size", 224)), int(vision.get("patch_size", 32))
    tokens = (image_size // patch) ** 2 + VISION_TOWERS[tower] - (strategy == "default")
    return VisionConfig(arch, token, tokens, layers, strategy == "default", raw.get("projector_hidden_act", "gelu"),
                        image_size, vision | {"model_type": tower})
