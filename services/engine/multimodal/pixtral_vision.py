"""Mistral 3's vision half: the Pixtral tower (any image size; its patches rotate by 2-D rotary
positions) and Mistral 3's projector (RMSNorm, a learned merge of 2x2 patches, two linear layers),
transformers' own modules loaded as encoder.py loads LLaVA's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kvrelay.engine.multimodal.encoder import VisionEncoder


class PixtralEncoder(VisionEncoder):
    @torch.inference_mode()
    def encode_many(self, images: list) -> list[torch.Tensor]:
        """Each SequenceImages' features, its images' rows of merged patches in order. The pixels of
        all are padded to one size (the tower reads each image's own size)."""
        h = max(im.pixel_values.shape[2] for im in images)
        w = max(im.pixel_values.shape[3] for im in images)
        pixels = torch.cat([F.pad(im.pixel_values, (0, w - im.pixel_values.shape[3], 0, h - im.pixel_values.shape[2]))
                            for im in images])
        sizes = torch.cat([im.image_sizes for im in images]).to(self.device)
        feats = self.projector(self.selected(pixels, image_sizes=sizes).squeeze(0), sizes)
        return list(feats.split([len(im.positions) for im in images]))
