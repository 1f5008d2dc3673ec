"""The vision half of a LLaVA model: its vision tower and the projector that maps the tower's
features into the decoder's embedding space.

Both are transformers' own modules for the model's config (the tower CLIP or SigLIP vision, the
projector the family's), loaded with the checkpoint's tensors: the tower runs once per image, at
the image's first prefill chunk, so the decoder's kernels and graphs are where the time goes, and
the reference implementation keeps every detail (class token, position interpolation, the layers
read, the projector's activation and biases) exact.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import torch
from kvrelay.engine.errors import ModelLoadError
from kvrelay.engine.multimodal.config import VisionConfig
from kvrelay.engine.weights import shard_files
from safetensors import safe_open

TOWER_PREFIXES = ("vision_tower.", "model.vision_tower.")
PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")
PROJECTORS = {  # architecture -> (transformers module, class)
    "LlavaForConditionalGeneration": ("llava.modeling_llava", "LlavaMultiModalProjector"),
    "LlavaNextForConditionalGeneration": ("llava_next.modeling_llava_next", "LlavaNextMultiModalProjector"),
    "Mistral3ForConditionalGeneration": ("mistral3.modeling_mistral3", "Mistral3MultiModalProjector"),
}


def transformers_class(module: str, name: str):
    """transformers.models.<module>.<name>."""
    return getattr(importlib.import_module(f"transformers.models.{module}"), name)


class Checkpoint:
    """The model folder's safetensors, read by name, a name found under any of a few prefixes
    (transformers saves LLaVA's tower as vision_tower.<key>, older checkpoints as
    vision_tower.vision_model.<key>, transformers' own layout adds "model.")."""

    def __init__(self, model_dir: Path):
        self.model_dir = model_dir
        self.files = shard_files(model_dir)

    def find(self, prefixes: tuple[str, ...], key: str, inner: tuple[str, ...] = ("",)) -> str:
        for p in prefixes:
            for mid in inner:
                if p + mid + key in self.files:
                    return p + mid + key
        raise ModelLoadError(f"{self.model_dir}: the vision-language checkpoint has no tensor for {prefixes[0]}{key}")

    def read(self, name: str) -> torch.Tensor:
        with safe_open(str(self.files[name]), framework="pt") as st:
            return st.get_tensor(name)

    def load_module(self, module: torch.nn.Module, prefixes: tuple[str, ...], inner: tuple[str, ...] = ("",)) -> None:
        """Every tensor of module's state dict, stored as <prefix><inner><key>."""
        state = {}
        for key, param in module.state_dict().items():
            t = self.read(self.find(prefixes, key, inner))
            if t.shape != param.shape:
                raise ModelLoadError(f"{self.model_dir}: vision tensor {key!r} has shape {list(t.shape)}, expected "
                                     f"{list(param.shape)} from config.json")
            state[key] = t
        module.load_state_dict(state)


class VisionEncoder:
    """LLaVA's tower and projector (Mistral 3's and LLaVA-NeXT's subclass it)."""

    def __init__(self, cfg: VisionConfig, model_dir: Path, dtype: torch.dtype, device: torch.device,
                 dummy: bool = False):
        import transformers

        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        config = transformers.AutoConfig.from_pretrained(model_dir)  # with its defaults
        self.tower = transformers.AutoModel.from_config(config.vision_config).eval()
        self.projector = transformers_class(*PROJECTORS[cfg.architecture])(config).eval()
        if not dummy:  # --load-format dummy: the modules' own initialisation
            ckpt = Checkpoint(model_dir)
            ckpt.load_module(self.tower, TOWER_PREFIXES, ("", "vision_model."))
            ckpt.load_module(self.projector, PROJECTOR_PREFIXES)
        self.tower.to(device=device, dtype=dtype)
        self.projector.to(device=device, dtype=dtype)

    def selected(self, pixel_values: torch.Tensor, **kwargs) -> torch.Tensor:
        """The tower's hidden states of the layers read, concatenated, less the class token where the
        model drops it."""
        out = self.tower(pixel_values.to(device=self.device, dtype=self.dtype), output_hidden_states=True, **kwargs)
        layers = [out.hidden_states[i] for i in self.cfg.feature_layers]
        if self.cfg.drop_class_token:
            layers = [h[:, 1:] for h in layers]
        return torch.cat(layers, dim=-1)

    @torch.inference_mode()
    def tiles(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Projected features per image (or LLaVA-NeXT tile): [images, tokens_per_image, text hidden]."""
        return self.projector(self.selected(pixel_values))

    def encode_many(self, images: list) -> list[torch.Tensor]:
        """Each SequenceImages' features, in one run of the tower."""
        feats = self.tiles(torch.cat([im.pixel_values for im in images]))
        return list(feats.reshape(-1, feats.shape[-1]).split([len(im.positions) for im in images]))


class LlavaNextEncoder(VisionEncoder):
    """LLaVA's tower and projector on each image's tiles, laid out by anyres.pack with the learned
    image_newline (LLaVA-NeXT)."""

    def __init__(self, cfg: VisionConfig, model_dir: Path, dtype: torch.dtype, device: torch.device,
                 dummy: bool = False):
        super().__init__(cfg, model_dir, dtype, device, dummy)
        if dummy:
            hidden = self.projector.linear_2.out_features
            newline = torch.randn(hidden, generator=torch.Generator().manual_seed(1)) * 0.02
        else:
            ckpt = Checkpoint(model_dir)
            newline = ckpt.read(ckpt.find(("", "model."), "image_newline"))
        self.newline = newline.to(device=device, dtype=dtype)

    @torch.inference_mode()
    def encode_many(self, images: list) -> list[torch.Tensor]:
        from kvrelay.engine.multimodal.anyres import num_tiles, pack

        sizes = [[tuple(s) for s in im.image_sizes.tolist()] for im in images]
        counts = [[num_tiles(self.cfg, s) for s in seq] for seq in sizes]
        # Each image's tiles without the processor's padding to the request's largest count, all in one run.
        tiles = self.tiles(torch.cat([im.pixel_values[k, :n] for im, seq in zip(images, counts)
                                      for k, n in enumerate(seq)]))
        parts = iter(tiles.split([n for seq in counts for n in seq]))
        return [torch.cat([pack(self.cfg, next(parts), s, self.newline) for s in seq]) for seq in sizes]
