"""The vision half of a LLaVA model: its vision tower and the projector that maps the tower's
features into the decoder's embedding space.

The tower is transformers' own module for its config (CLIP or SigLIP vision), loaded with the
checkpoint's tensors: it runs once per image, at the image's first prefill chunk, so the decoder's
kernels and graphs are where the time goes, and the reference implementation keeps every tower
detail (class token, position interpolation, the layers read) exact. The projector is two linear
layers around the config's activation.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from kvrelay.engine.errors import ModelLoadError
from kvrelay.engine.multimodal.config import VisionConfig
from kvrelay.engine.weights import shard_files
from safetensors import safe_open

log = logging.getLogger(__name__)

TOWER_PREFIXES = ("vision_tower.", "model.vision_tower.")
PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")


def require_transformers():
    try:
        import transformers
    except ImportError as e:
        raise ModelLoadError("vision-language models need transformers (their vision tower and image "
                             "processor): pip install 'kvrelay[multimodal]'") from e
    return transformers


def _finder(model_dir: Path, files: dict[str, Path]):
    def find(prefixes: tuple[str, ...], key: str, inner: tuple[str, ...] = ("",)) -> str:
        for p in prefixes:
            for mid in inner:
                if p + mid + key in files:
                    return p + mid + key
        raise ModelLoadError(f"{model_dir}: the vision-language checkpoint has no tensor for {prefixes[0]}{key}")

    return find


def _reader(files: dict[str, Path]):
    def read(name: str) -> torch.Tensor:
        with safe_open(str(files[name]), framework="pt") as st:
            return st.get_tensor(name)

    return read


def load_module(module: torch.nn.Module, model_dir: Path, files: dict[str, Path], prefixes: tuple[str, ...],
                inner: tuple[str, ...] = ("",)) -> None:
    """Every tensor of module's state dict from the checkpoint, stored as <prefix><inner><key>."""
    find, read = _finder(model_dir, files), _reader(files)
    state = {}
    for key, param in module.state_dict().items():
        t = read(find(prefixes, key, inner))
        if t.shape != param.shape:
            raise ModelLoadError(f"{model_dir}: vision tensor {key!r} has shape {list(t.shape)}, expected "
                                 f"{list(param.shape)} from vision_config")
        state[key] = t
    module.load_state_dict(state)


class VisionEncoder:
    def __init__(self, cfg: VisionConfig, model_dir: Path, text_hidden: int, dtype: torch.dtype,
                 device: torch.device, dummy: bool = False):
        transformers = require_transformers()
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        tower_config = transformers.CONFIG_MAPPING[cfg.vision["model_type"]](**cfg.vision)
        self.tower = transformers.AutoModel.from_config(tower_config).eval()
        self.act = transformers.activations.ACT2FN[cfg.projector_act]
        in_features = tower_config.hidden_size * len(cfg.feature_layers)
        shapes = {"linear_1.weight": (text_hidden, in_features), "linear_2.weight": (text_hidden, text_hidden)}
        if dummy:  # --load-format dummy: the tower's own initialisation, a random projector
            gen = torch.Generator().manual_seed(0)
            self.proj = {k: torch.randn(s, generator=gen) * 0.02 for k, s in shapes.items()}
        else:
            self.proj = self._load(model_dir, shapes)
        self.tower.to(device=device, dtype=dtype)
        self.proj = {k: v.to(device=device, dtype=dtype) for k, v in self.proj.items()}

    def _load(self, model_dir: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        files = shard_files(model_dir)
        # transformers saves CLIP's tower as vision_tower.<key>; older checkpoints as vision_tower.vision_model.<key>
        load_module(self.tower, model_dir, files, TOWER_PREFIXES, ("", "vision_model."))
        find, read = _finder(model_dir, files), _reader(files)
        proj = {}
        for key, shape in shapes.items():
            t = read(find(PROJECTOR_PREFIXES, key))
            if tuple(t.shape) != shape:
                raise ModelLoadError(f"{model_dir}: projector tensor {key!r} has shape {list(t.shape)}, expected "
                                     f"{list(shape)}")
            proj[key] = t
            bias = key.replace("weight", "bias")
            if any(p + bias in files for p in PROJECTOR_PREFIXES):
                proj[bias] = read(find(PROJECTOR_PREFIXES, bias))
        return proj

    def encode_many(self, images: list) -> list[torch.Tensor]:
        """Each SequenceImages' features, in one run of the tower."""
        feats = self.encode(torch.cat([im.pixel_values for im in images]))
        return list(feats.split([len(im.positions) for im in images]))

    @torch.inference_mode()
    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | None = None) -> torch.Tensor:
        """Features of a prompt's images, in order: [images * tokens_per_image, text hidden]."""
        feats = self.tiles(pixel_values)
        return feats.reshape(-1, feats.shape[-1])

    @torch.inference_mode()
    def tiles(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Projected features per image (or LLaVA-NeXT tile): [images, tokens_per_image, text hidden]."""
        out = self.tower(pixel_values.to(device=self.device, dtype=self.dtype), output_hidden_states=True)
        layers = [out.hidden_states[i] for i in self.cfg.feature_layers]
        if self.cfg.drop_class_token:
            layers = [h[:, 1:] for h in layers]
        feats = torch.cat(layers, dim=-1)
        p = self.proj
        return F.linear(self.act(F.linear(feats, p["linear_1.weight"], p.get("linear_1.bias"))),
                        p["linear_2.weight"], p.get("linear_2.bias"))


class LlavaNextEncoder(VisionEncoder):
    """LLaVA's tower and projector on each image's tiles, laid out by anyres.pack with the learned
    image_newline (LLaVA-NeXT)."""

    def __init__(self, cfg: VisionConfig, model_dir: Path, text_hidden: int, dtype: torch.dtype,
                 device: torch.device, dummy: bool = False):
        super().__init__(cfg, model_dir, text_hidden, dtype, device, dummy)
        if dummy:
            newline = torch.randn(text_hidden, generator=torch.Generator().manual_seed(1)) * 0.02
        else:
            files = shard_files(model_dir)
            newline = _reader(files)(_finder(model_dir, files)(("", "model."), "image_newline"))
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
