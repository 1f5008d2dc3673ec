"""What a vision-language model's config.json says about its images: which token stands for an
image, how many of them one image becomes, and how its vision tower's features are read."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvrelay.engine.errors import ModelLoadError

LLAVA = ("LlavaForConditionalGeneration", "LlavaNextForConditionalGeneration")
QWEN_VL = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration")
MISTRAL3 = ("Mistral3ForConditionalGeneration",)
VISION_LANGUAGE_ARCHITECTURES = LLAVA + QWEN_VL + MISTRAL3
# Vision towers with a fixed image size (one image, one run of placeholder tokens); the class token
# they prepend, if any.
VISION_TOWERS = {"clip_vision_model": 1, "siglip_vision_model": 0}


@dataclass(frozen=True)
class VisionConfig:
    architecture: str
    image_token_id: int
    # Placeholder tokens of one image in the prompt (its projected features); None: by the image's
    # size (Qwen2-VL: its patch grid over spatial_merge squared).
    tokens_per_image: int | None
    vision: dict  # config.json's vision_config, for the tower's own config class
    # LLaVA's and Mistral 3's tower
    feature_layers: tuple[int, ...] = ()  # hidden states read (concatenated when several)
    drop_class_token: bool = False  # vision_feature_select_strategy "default": the first feature is dropped
    image_size: int = 0
    # Qwen2-VL, Mistral 3: patches merged per feature along each side
    spatial_merge: int = 1
    patch_size: int = 0  # Mistral 3 (Pixtral): pixels per patch side
    grid_pinpoints: tuple[tuple[int, int], ...] = ()  # LLaVA-NeXT: the sizes an image is tiled at (anyres.py)

    @property
    def anyres(self) -> bool:
        return bool(self.grid_pinpoints)

    @property
    def qwen(self) -> bool:
        return self.architecture in QWEN_VL

    @property
    def pixtral(self) -> bool:
        """Mistral 3's Pixtral tower: an image of any size, its rows of features ended by [IMG_BREAK]."""
        return self.architecture in MISTRAL3

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
    if arch in QWEN_VL:
        token = raw.get("image_token_id", (raw.get("text_config") or {}).get("image_token_id"))
        if not isinstance(token, int):
            raise ModelLoadError(f"{path}: a Qwen2-VL config needs image_token_id")
        return VisionConfig(arch, token, None, vision, spatial_merge=int(vision.get("spatial_merge_size", 2)))
    if arch in MISTRAL3:
        token = raw.get("image_token_index", raw.get("image_token_id"))
        if not isinstance(token, int):
            raise ModelLoadError(f"{path}: a Mistral 3 config needs image_token_index")
        layer = raw.get("vision_feature_layer", -1)
        return VisionConfig(arch, token, None, vision, feature_layers=(layer,) if isinstance(layer, int) else tuple(layer),
                            spatial_merge=int(raw.get("spatial_merge_size", 2)),
                            patch_size=int(vision.get("patch_size", 16)))
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
    pinpoints = ()
    if arch == "LlavaNextForConditionalGeneration":  # a count per image, by its size
        pinpoints = tuple(tuple(p) for p in raw.get("image_grid_pinpoints") or [])
        if not pinpoints or tokens != (image_size // patch) ** 2:
            raise ModelLoadError(f"{path}: LLaVA-NeXT needs image_grid_pinpoints and one feature per patch "
                                 "(a CLIP tower with vision_feature_select_strategy default)")
        tokens = None
    return VisionConfig(arch, token, tokens, vision, layers, strategy == "default",
                        image_size, grid_pinpoints=pinpoints)
