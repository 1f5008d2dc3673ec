"""A vision-language model's images on the API side: decoded, made into pixels by the model's own
image processor (transformers' AutoImageProcessor, as the model folder configures it), and the
rendered prompt's image markers expanded into the placeholder run each image's features fill."""

from __future__ import annotations

import hashlib
import io
import warnings
from pathlib import Path

from kvrelay.engine.multimodal.config import VisionConfig, read_vision_config
from kvrelay.engine.multimodal.inputs import ImageInputs, ImagePrompt
from kvrelay.gateway import errors


def decode_image(data: bytes, field: str):
    """An RGB PIL image; a 400 naming field for bytes that are no image, or a decompression bomb
    (more pixels than PIL's MAX_IMAGE_PIXELS)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            picture = Image.open(io.BytesIO(data))
            picture.load()
        return picture.convert("RGB")
    except (UnidentifiedImageError, Image.DecompressionBombWarning, Image.DecompressionBombError, OSError,
            ValueError) as e:
        raise errors.bad_request(f"{field}: not an image this server can read: {e}", field) from e


class ImageProcessor:
    def __init__(self, model_dir: Path, cfg: VisionConfig):
        from transformers import AutoImageProcessor

        self.cfg = cfg
        self.processor = AutoImageProcessor.from_pretrained(model_dir)
        self.kwargs = {}
        if cfg.pixtral:  # Pixtral's processor sizes images in whole merged patches; its rows end in tokens of their own
            from tokenizers import Tokenizer

            self.kwargs = {"patch_size": cfg.patch_size * cfg.spatial_merge}
            vocab = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
            self.row_ends = [vocab.token_to_id(t) for t in ("[IMG_BREAK]", "[IMG_END]")]
            if None in self.row_ends:
                raise ValueError(f"{model_dir}: a Mistral 3 tokenizer needs the tokens [IMG_BREAK] and [IMG_END]")

    @classmethod
    def for_model(cls, model_dir: Path) -> ImageProcessor | None:
        """The model's processor; None for a text-only model."""
        cfg = read_vision_config(model_dir)
        return None if cfg is None else cls(model_dir, cfg)

    def prompt(self, ids: list[int], pictures: list, fields: list[str]) -> ImagePrompt:
        """ids: the rendered chat, one image marker (the image token) per picture, in order."""
        markers = sum(1 for t in ids if t == self.cfg.image_token_id)
        if markers != len(pictures):
            raise errors.bad_request(
                f"messages: the chat template placed {markers} image markers for {len(pictures)} images: this "
                "model's template does not show images where the messages put them", "messages")
        try:
            out = self.processor(pictures, return_tensors="pt", **self.kwargs)
        except (ValueError, TypeError) as e:  # e.g. an image with a zero side
            raise errors.bad_request(f"{fields[0] if len(fields) == 1 else 'messages'}: the image processor "
                                     f"refused the image: {e}", "messages") from e
        pixels, grid, sizes = out["pixel_values"].float(), out.get("image_grid_thw"), out.get("image_sizes")
        token = self.cfg.image_token_id
        if self.cfg.pixtral:  # padded to the largest; per image h' rows of w' features, each row ended
            step = self.cfg.patch_size * self.cfg.spatial_merge
            per_image = [pixels[i, :, :h, :w] for i, (h, w) in enumerate(sizes.tolist())]
            runs = []
            for h, w in sizes.tolist():
                run = ([token] * (w // step) + [self.row_ends[0]]) * (h // step)
                runs.append(run[:-1] + [self.row_ends[1]])
        elif self.cfg.anyres:  # LLaVA-NeXT: each image's tiles (padded to the most), a count by its size
            from kvrelay.engine.multimodal.anyres import feature_count, num_tiles

            per_image = [pixels[k, : num_tiles(self.cfg, tuple(s))] for k, s in enumerate(sizes.tolist())]
            runs = [[token] * feature_count(self.cfg, tuple(s)) for s in sizes.tolist()]
        elif grid is not None:  # Qwen2-VL: each image's patches, as many as its grid has
            per_image = pixels.split(grid.prod(-1).tolist())
            runs = [[token] * n for n in (grid.prod(-1) // self.cfg.spatial_merge**2).tolist()]
        else:  # one [C, H, W] per image
            per_image, runs = list(pixels), [[token] * self.cfg.tokens_per_image] * len(pictures)
        hashes = tuple(hashlib.sha256(p.contiguous().numpy().tobytes()).hexdigest() for p in per_image)
        return ImagePrompt(self.expand(ids, runs), ImageInputs(pixels, hashes, grid, sizes))

    def expand(self, ids: list[int], runs: list[list[int]] | None = None) -> list[int]:
        """Each image marker replaced by the run of tokens its image takes: runs, one per marker in
        order (None: the model's fixed count of placeholders; a model whose count follows the image's
        size cannot count without it)."""
        token = self.cfg.image_token_id
        if runs is None:
            markers = sum(1 for t in ids if t == token)
            if markers and self.cfg.tokens_per_image is None:
                raise errors.bad_request("messages: this model's images take as many tokens as their size asks: "
                                         "they are counted where the images are read (usage.prompt_tokens)",
                                         "messages")
            runs = [[token] * (self.cfg.tokens_per_image or 0)] * markers
        it = iter(runs)
        out: list[int] = []
        for t in ids:
            out.extend(next(it) if t == token else (t,))
        return out


async def fetch_chat_images(body, processor: ImageProcessor | None, limits) -> list[tuple[str, bytes]] | None:
    """The chat request's images, encoded, with their fields (media.py); None when it has none, or
    when the model reads none (chat_render.template_messages then refuses them: nothing is fetched)."""
    import httpx
    from kvrelay.gateway import chat_render, media

    parts = chat_render.image_parts(body.messages)
    if not parts or processor is None:
        return None
    async with httpx.AsyncClient(follow_redirects=False, timeout=limits.fetch_timeout_s) as client:
        data = await media.load_images(parts, limits, client)
    return [(field, d) for (field, _), d in zip(parts, data)]


def chat_image_prompt(processor: ImageProcessor, ids: list[int], images: list[tuple[str, bytes]]) -> ImagePrompt:
    """The rendered chat's ids with its images: decoded, processed, and their markers expanded."""
    pictures = [decode_image(data, field) for field, data in images]
    return processor.prompt(ids, pictures, [field for field, _ in images])
