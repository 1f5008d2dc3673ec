"""A tiny LLaVA for the vision-language tests: the bundled tokenizer with an `<image>` token, a random
CLIP vision tower (32x32 images, 8x8 patches: 16 features per image), a random Llama decoder, and
the model's own LlavaProcessor; saved with save_pretrained, as a real checkpoint is. Plus the
transformers reference: the processor's ids and pixels, and greedy generate."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kvrelay.models import BUNDLED_MODEL

IMAGE_TOKEN = "<image>"
TOKENS_PER_IMAGE = 16
# Image parts become `<image>` markers where they stand, as llava-hf's templates place them.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {% if m.content is string %}{{ m.content }}{% else %}"
    "{% for c in m.content %}{% if c.type == 'image' %}<image>{% elif c.type == 'text' %}{{ c.text }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def save_tiny_llava(path: Path, strategy: str = "default", feature_layer: int | list[int] = -2) -> Path:
    import transformers

    tok = transformers.PreTrainedTokenizerFast.from_pretrained(BUNDLED_MODEL)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    # The decoder is the bundled model (real weights: its text depends on what it sees), one embedding
    # row longer for `<image>`.
    text = transformers.LlamaConfig.from_pretrained(BUNDLED_MODEL)
    text.vocab_size = len(tok)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=4, image_size=32, patch_size=8, projection_dim=32)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=len(tok) - 1,
                                      vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy,
                                      image_seq_length=TOKENS_PER_IMAGE + (strategy == "full"),
                                      tie_word_embeddings=True)
    torch.manual_seed(7)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    decoder = transformers.LlamaForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32)
    decoder.resize_token_embeddings(len(tok), mean_resizing=False)
    model.model.language_model.load_state_dict(decoder.model.state_dict())
    with torch.no_grad():  # larger projector weights: the images visibly steer the decoder
        for p in model.model.multi_modal_projector.parameters():
            p.mul_(8)
    model.save_pretrained(path)
    images = transformers.CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = transformers.LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=8,
                                            vision_feature_select_strategy=strategy, num_additional_image_tokens=1,
                                            chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)
    return path


def image(seed: int, size: tuple[int, int] = (40, 48)):
    """A random RGB picture (PIL), not square: the processor resizes and crops it."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def png_bytes(picture) -> bytes:
    import io

    buf = io.BytesIO()
    picture.save(buf, format="PNG")
    return buf.getvalue()


def hf_inputs(path: Path, text: str, images: list):
    """The processor's input_ids (placeholders expanded) and pixel_values."""
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(path)
    enc = processor(text=text, images=images or None, return_tensors="pt")
    return enc["input_ids"][0].tolist(), enc.get("pixel_values")


def hf_greedy(path: Path, ids: list[int], pixel_values, max_new_tokens: int) -> list[int]:
    import transformers

    model = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), pixel_values=pixel_values, do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(ids):].tolist()
