"""A prompt's images on their way to the engine, and on the sequence once there.

The gateway sends an ImagePrompt: the prompt's token ids, with as many of each image's placeholder
token as the image has features (in one run, or Mistral 3's rows), carrying the processed pixels. It is a list of ids, so
everything that passes prompts along (counting, quotas, the engine-core pipe) keeps working; a
copy or slice is a plain list and loses the images, which the engine then refuses (placeholders
without images), so a prompt is never run with the placeholder token's own embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from kvrelay.engine.multimodal.mrope import mrope_positions


@dataclass(frozen=True)
class ImageInputs:
    # As the image processor made them, float32: [images, channels, height, width] (LLaVA; Mistral 3,
    # padded to the largest), or every image's flattened patches [patches, channels * 2 * 14 * 14] (Qwen2-VL).
    pixel_values: torch.Tensor
    hashes: tuple[str, ...]  # per image, of its pixels: prompts share cached K/V only with the same images
    grid_thw: torch.Tensor | None = None  # Qwen2-VL: each image's patch grid [images, 3]
    image_sizes: torch.Tensor | None = None  # Mistral 3: each image's (height, width) in the padded pixels


class ImagePrompt(list):
    """Token ids with their images (see the module's docstring)."""

    def __init__(self, token_ids: list[int], images: ImageInputs):
        super().__init__(token_ids)
        self.images = images


@dataclass(eq=False)
class SequenceImages:
    """A sequence's images: their pixels until the vision tower has run, then their features,
    kept until the sequence finishes (a preempted sequence recomputes its prompt)."""

    pixel_values: torch.Tensor | None
    positions: np.ndarray  # int64, ascending: the prompt positions of the placeholder tokens
    embeds: torch.Tensor | None = None  # [len(positions), hidden], the projected features in order
    grid_thw: torch.Tensor | None = None  # Qwen2-VL: the images' patch grids, for the tower
    image_sizes: torch.Tensor | None = None  # Mistral 3: the images' sizes, for the tower
    # Qwen2-VL (mrope.py): the prompt's rotary positions [3, prompt_len] and, past the prompt, the
    # offset of rotary position from token position; None without M-RoPE.
    rope: np.ndarray | None = None
    rope_delta: int = 0
    # The prompt's ids for prefix-cache keys: each placeholder as its image's key (cache_keys).
    keys: np.ndarray | None = None
    # Qwen3-VL: the tower's middle layers' features [levels, len(positions), hidden], added to the
    # first decoder layers' outputs at the placeholder rows ("deepstack").
    deepstack: torch.Tensor | None = None

    def reaches(self, start: int, count: int) -> bool:
        """Whether positions [start, start + count) hold placeholders (the step needs features)."""
        lo, hi = np.searchsorted(self.positions, [start, start + count])
        return bool(lo < hi)


@dataclass
class StepImages:
    """A step's image rows (StepBatch.images): they take features instead of token embeddings."""

    rows: torch.Tensor  # [rows] int64, rows of the step's tokens
    embeds: torch.Tensor  # [rows, hidden]
    # Qwen3-VL: added to the outputs of the first decoder layers at the rows [levels, rows, hidden].
    deepstack: torch.Tensor | None = None
    # M-RoPE (mrope.py): the rows' (time, height, width) positions [3, rows], which differ, so each row
    # rotates by a cos/sin row of its own.
    rope_positions: torch.Tensor | None = None


def image_rows(spans: list[tuple[SequenceImages, int, int, int]], device: torch.device) -> StepImages | None:
    """The step's image rows and their features; None when the step has none.
    spans: (images, first position, tokens, first row in the step) per scheduled chunk."""
    rows, parts, deep, rope = [], [], [], []
    for images, start, count, first_row in spans:
        lo, hi = np.searchsorted(images.positions, [start, start + count])
        if lo < hi:
            at = images.positions[lo:hi]
            rows.append(at - start + first_row)
            parts.append(images.embeds[lo:hi])
            if images.deepstack is not None:
                deep.append(images.deepstack[:, lo:hi])
            if images.rope is not None:
                rope.append(images.rope[:, at])
    if not rows:
        return None
    return StepImages(torch.from_numpy(np.concatenate(rows)).to(device), torch.cat(parts),
                      torch.cat(deep, 1) if deep else None,
                      torch.from_numpy(np.concatenate(rope, axis=1)).to(device) if rope else None)


def prompt_images(encoder, prompt, ids: list[int]) -> SequenceImages | None:
    """The images of a prompt for a sequence, checked against its placeholder tokens; None when it
    has none. encoder: the engine's VisionEncoder, None for a text-only model. Raises
    InvalidRequestError for images a model cannot read or placeholders without their images."""
    from kvrelay.engine.errors import InvalidRequestError

    images: ImageInputs | None = getattr(prompt, "images", None)
    if encoder is None:
        if images is not None:
            raise InvalidRequestError("this model takes text only: it cannot read images", field="messages")
        return None
    cfg = encoder.cfg
    array = np.asarray(ids, dtype=np.int64)
    positions = np.flatnonzero(array == cfg.image_token_id)
    counts = [] if images is None else image_token_counts(cfg, images)
    if len(positions) != sum(counts):
        raise InvalidRequestError(
            f"prompt: holds {len(positions)} image placeholder tokens (id {cfg.image_token_id}), but its "
            f"{len(counts)} image(s) take {sum(counts)} ({', '.join(map(str, counts)) or 'none'}): send images as "
            "chat content parts and do not cut the prompt inside an image", field="prompt")
    if not counts:
        return None
    keys = cache_keys(array, positions, counts, images.hashes)
    if cfg.qwen:
        grids = [tuple(g) for g in images.grid_thw.tolist()]
        rope, delta = mrope_positions(array, cfg.image_token_id, grids, cfg.spatial_merge)
        return SequenceImages(images.pixel_values, positions, grid_thw=images.grid_thw, rope=rope, rope_delta=delta,
                              keys=keys)
    if cfg.pixtral or cfg.anyres:
        return SequenceImages(images.pixel_values, positions, image_sizes=images.image_sizes, keys=keys)
    if tuple(images.pixel_values.shape[1:]) != cfg.pixel_shape:
        raise InvalidRequestError(f"images: pixel values of shape {list(images.pixel_values.shape[1:])}, but the "
                                  f"vision tower takes {list(cfg.pixel_shape)}", field="messages")
    return SequenceImages(images.pixel_values, positions, keys=keys)


def cache_keys(ids: np.ndarray, positions: np.ndarray, counts: list[int], hashes: tuple[str, ...]) -> np.ndarray:
    """The prompt's ids with each image's placeholders replaced by a key of that image (a negative id,
    never a token's): the prefix cache's block keys then tell images apart where their placeholder
    ids are alike, and blocks before an image stay shared with prompts of other images or none."""
    import hashlib

    if len(hashes) != len(counts):
        from kvrelay.engine.errors import InvalidRequestError

        raise InvalidRequestError(f"images: {len(hashes)} hashes for {len(counts)} images", field="messages")
    keys = ids.copy()
    start = 0
    for n, h in zip(counts, hashes):
        key = int.from_bytes(hashlib.blake2b(h.encode(), digest_size=8).digest(), "little") >> 2
        keys[positions[start : start + n]] = -1 - key
        start += n
    return keys


def image_token_counts(cfg, images: ImageInputs) -> list[int]:
    """Placeholder tokens per image: fixed (LLaVA); by its size (LLaVA-NeXT's tiles, Mistral 3's merged
    patches); or each grid's t*h*w over the merge squared (Qwen2-VL)."""
    from kvrelay.engine.errors import InvalidRequestError

    if cfg.anyres or cfg.pixtral:
        sizes = images.image_sizes
        if sizes is None or sizes.shape != (images.pixel_values.shape[0], 2):
            raise InvalidRequestError(f"images: {cfg.architecture} images need their sizes (image_sizes), one "
                                      "(height, width) row per image", field="messages")
        if cfg.pixtral:
            return ((sizes // (cfg.patch_size * cfg.spatial_merge)).prod(-1)).tolist()
        from kvrelay.engine.multimodal.anyres import feature_count

        return [feature_count(cfg, tuple(s)) for s in sizes.tolist()]
    if not cfg.qwen:
        return [cfg.tokens_per_image] * images.pixel_values.shape[0]
    grid = images.grid_thw
    if grid is None or grid.ndim != 2 or grid.shape[1] != 3 or int(grid.prod(-1).sum()) != images.pixel_values.shape[0]:
        raise InvalidRequestError("images: Qwen2-VL images need their patch grids (image_grid_thw), one row per "
                                  "image, covering every patch of pixel_values", field="messages")
    return (grid.prod(-1) // cfg.spatial_merge**2).tolist()
