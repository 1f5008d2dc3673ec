"""LLaVA-NeXT's "anyres" images: an image is resized to the best of the model's grid pinpoints and
cut into tiles of the tower's size, plus one tile of the whole image. Each tile's features come
from LLaVA's tower and projector (encoder.py); the tiles' features are then laid out as the image
(less the padding the resize added), each row ended by the learned `image_newline`, after the
whole-image tile's features. transformers' own functions choose the grid and cut the padding, so
the layout (and the feature count the gateway expands each image into) is the reference's.
"""

from __future__ import annotations

import torch
from kvrelay.engine.multimodal.config import VisionConfig


def num_tiles(cfg: VisionConfig, size: tuple[int, int]) -> int:
    """Tiles of an image of size (height, width): the grid's, plus the whole image's."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    return image_size_to_num_patches(list(size), [list(p) for p in cfg.grid_pinpoints], cfg.image_size)


def pack(cfg: VisionConfig, tiles: torch.Tensor, size: tuple[int, int], newline: torch.Tensor) -> torch.Tensor:
    """One image's features [features, hidden] from its tiles' [tiles, side * side, hidden]."""
    from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape, unpad_image

    base, tiles = tiles[0], tiles[1:]
    side = cfg.image_size // int(cfg.vision.get("patch_size", 14))
    rows, cols = get_anyres_image_grid_shape(list(size), [list(p) for p in cfg.grid_pinpoints], cfg.image_size)
    grid = tiles.view(rows, cols, side, side, -1).permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)
    grid = unpad_image(grid, torch.tensor(size))
    grid = torch.cat([grid, newline[:, None, None].expand(*grid.shape[:-1], 1).to(grid.dtype)], dim=-1)
    return torch.cat([base, grid.flatten(1, 2).transpose(0, 1)])


def feature_count(cfg: VisionConfig, size: tuple[int, int]) -> int:
    """How many placeholder tokens an image of size (height, width) takes: pack's length, on shapes."""
    side = cfg.image_size // int(cfg.vision.get("patch_size", 14))
    tiles = torch.zeros(num_tiles(cfg, size), side * side, 1)
    return pack(cfg, tiles, size, torch.zeros(1)).shape[0]
