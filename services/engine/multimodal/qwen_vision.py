"""The Qwen-VL vision transformers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): patches in (the image processor's flattened
14x14x2 patches and each image's (t, h, w) grid), merged features out, one per 2x2 patches, already
in the decoder's width. transformers' own module for the config, loaded from the checkpoint's
"visual." tensors, as encoder.py does for LLaVA's tower."""

from __future__ import annotations

from pathlib import Path

import torch
from kvrelay.engine.multimodal.config import VisionConfig
from kvrelay.engine.multimodal.encoder import Checkpoint, transformers_class

TOWERS = {  # architecture -> (transformers module, class)
    "Qwen2VLForConditionalGeneration": ("qwen2_vl.modeling_qwen2_vl", "Qwen2VisionTransformerPretrainedModel"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl.modeling_qwen2_5_vl",
                                           "Qwen2_5_VisionTransformerPretrainedModel"),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl.modeling_qwen3_vl", "Qwen3VLVisionModel"),
}


class QwenVisionEncoder:
    def __init__(self, cfg: VisionConfig, model_dir: Path, dtype: torch.dtype, device: torch.device,
                 dummy: bool = False):
        import transformers

        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        vision_config = transformers.AutoConfig.from_pretrained(model_dir).vision_config  # with its defaults
        self.tower = transformers_class(*TOWERS[cfg.architecture])._from_config(vision_config).eval()
        if not dummy:
            Checkpoint(model_dir).load_module(self.tower, ("visual.", "model.visual."))
        self.tower.to(device=device, dtype=dtype)

    @torch.inference_mode()
    def encode_many(self, images: list) -> list[torch.Tensor]:
        """Each SequenceImages' features, in one run of the tower; Qwen3-VL's deepstack features are
        set on each (SequenceImages.deepstack)."""
        grid = torch.cat([im.grid_thw for im in images])
        out = self.tower(torch.cat([im.pixel_values for im in images]).to(device=self.device, dtype=self.dtype),
                         grid_thw=grid.to(self.device))
        sizes = [len(im.positions) for im in images]
        deep = getattr(out, "deepstack_features", None)
        if deep:
            for im, part in zip(images, torch.stack(deep).split(sizes, dim=1)):
                im.deepstack = part
        # transformers before 5.2x returned the tensor itself (Qwen2-VL)
        return list(getattr(out, "pooler_output", out).split(sizes))
