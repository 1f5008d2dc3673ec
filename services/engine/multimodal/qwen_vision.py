"""Qwen2-VL's and Qwen2.5-VL's vision transformer: patches in (the image processor's flattened
14x14x2 patches and each image's (t, h, w) grid), merged features out, one per 2x2 patches, already
in the decoder's width. transformers' own module for the config, loaded from the checkpoint's
"visual." tensors, as encoder.py does for LLaVA's tower."""

from __future__ import annotations

import importlib
from pathlib import Path

import torch
from kvrelay.engine.multimodal.config import VisionConfig
from kvrelay.engine.multimodal.encoder import load_module, require_transformers
from kvrelay.engine.weights import shard_files

TOWERS = {  # architecture -> (transformers module, class)
    "Qwen2VLForConditionalGeneration": ("qwen2_vl.modeling_qwen2_vl", "Qwen2VisionTransformerPretrainedModel"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl.modeling_qwen2_5_vl",
                                           "Qwen2_5_VisionTransformerPretrainedModel"),
}


class QwenVisionEncoder:
    def __init__(self, cfg: VisionConfig, model_dir: Path, dtype: torch.dtype, device: torch.device,
                 dummy: bool = False):
        transformers = require_transformers()
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        vision_config = transformers.AutoConfig.from_pretrained(model_dir).vision_config  # with its defaults
        module, name = TOWERS[cfg.architecture]
        tower_cls = getattr(importlib.import_module(f"transformers.models.{module}"), name)
        self.tower = tower_cls._from_config(vision_config).eval()
        if not dummy:
            load_module(self.tower, model_dir, shard_files(model_dir), ("visual.", "model.visual."))
        self.tower.to(device=device, dtype=dtype)

    def encode_many(self, images: list) -> list[torch.Tensor]:
        """Each SequenceImages' features, in one run of the tower."""
        feats = self.encode(torch.cat([im.pixel_values for im in images]), torch.cat([im.grid_thw for im in images]))
        return list(feats.split([len(im.positions) for im in images]))

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """Merged features of a prompt's images, in order: [sum of each grid's t*h*w / merge^2, hidden]."""
        out = self.tower(pixel_values.to(device=self.device, dtype=self.dtype), grid_thw=grid_thw.to(self.device))
        return getattr(out, "pooler_output", out)  # transformers before 5.2x returned the tensor itself
