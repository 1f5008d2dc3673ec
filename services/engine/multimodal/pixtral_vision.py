"""Mistral 3's vision half: the Pixtral tower (any image size; its patches rotate by 2-D rotary
positions) and Mistral 3's projector (RMSNorm, a learned merge of 2x2 patches, two linear layers),
both transformers' own modules for the config, loaded from the checkpoint as encoder.py does."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from kvrelay.engine.multimodal.config import VisionConfig
from kvrelay.engine.multimodal.encoder import (
    PROJECTOR_PREFIXES,
    TOWER_PREFIXES,
    load_module,
    require_transformers,
)
from kvrelay.engine.weights import shard_files


class PixtralEncoder:
    def __init__(self, cfg: VisionConfig, model_dir: Path, dtype: torch.dtype, device: torch.device,
                 dummy: bool = False):
        transformers = require_transformers()
        from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector

        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        config = transformers.AutoConfig.from_pretrained(model_dir)  # with its defaults
        self.tower = transformers.AutoModel.from_config(config.vision_config).eval()
        self.projector = Mistral3MultiModalProjector(config).eval()
        if not dummy:
            files = shard_files(model_dir)
            load_module(self.tower, model_dir, files, TOWER_PREFIXES)
            load_module(self.projector, model_dir, files, PROJECTOR_PREFIXES)
        self.tower.to(device=device, dtype=dtype)
        self.projector.to(device=device, dtype=dtype)

    @torch.inference_mode()
    def encode_many(self, images: list) -> list[torch.Tensor]:
        """Each SequenceImages' features, its images' rows of merged patches in order. The pixels of
        all are padded to one size (the tower reads each image's own size)."""
        h = max(im.pixel_values.shape[2] for im in images)
        w = max(im.pixel_values.shape[3] for im in images)
        pixels = torch.cat([F.pad(im.pixel_values, (0, w - im.pixel_values.shape[3], 0, h - im.pixel_values.shape[2]))
                            for im in images])
        sizes = torch.cat([im.image_sizes for im in images]).to(self.device)
        out = self.tower(pixels.to(device=self.device, dtype=self.dtype), image_sizes=sizes, output_hidden_states=True)
        layers = [out.hidden_states[i] for i in self.cfg.feature_layers]
        feats = self.projector(torch.cat(layers, dim=-1).squeeze(0), sizes)
        return list(feats.split([len(im.positions) for im in images]))
