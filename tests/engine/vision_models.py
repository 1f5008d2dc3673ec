"""Tiny vision-language models for the tests, saved with save_pretrained as real checkpoints are:
LLaVA and LLaVA-NeXT (a random CLIP tower, 32x32 images or tiles, 8x8 patches: 16 features each),
Qwen2-VL / Qwen2.5-VL / Qwen3-VL and Mistral 3, each with the bundled model's real weights as its
decoder and the bundled tokenizer with the model's image tokens. Plus the transformers reference:
what each model's processor gives (ids with placeholders expanded, pixels), and greedy generate."""

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


def _tokenizer(*special: str):
    """The bundled tokenizer with the model's image tokens (ids 512 on)."""
    import transformers

    tok = transformers.PreTrainedTokenizerFast.from_pretrained(BUNDLED_MODEL)
    tok.add_special_tokens({"additional_special_tokens": list(special)})
    return tok


def _llava_parts(tok):
    """(text config, vision config) of the tiny LLaVAs: the bundled decoder, one embedding row longer
    per image token, and a random CLIP tower (32 px, 8 px patches)."""
    import transformers

    text = transformers.LlamaConfig.from_pretrained(BUNDLED_MODEL)
    text.vocab_size = len(tok)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                           num_attention_heads=4, image_size=32, patch_size=8, projection_dim=32)
    return text, vision


def _load_decoder(model, tok, boosted) -> None:
    """The bundled model's real weights into model's decoder (its text then depends on what it sees;
    parameters it lacks: biases zero, norms one), and the boosted weights times 8 (so that the images
    visibly steer it)."""
    import transformers

    stories = transformers.LlamaForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32)
    stories.resize_token_embeddings(len(tok), mean_resizing=False)
    state = stories.model.state_dict()
    with torch.no_grad():
        for name, p in model.model.language_model.named_parameters():
            p.copy_(state[name] if name in state else torch.ones_like(p) if name.endswith("norm.weight")
                    else torch.zeros_like(p))
        for p in boosted:
            p.mul_(8)


def save_tiny_llava(path: Path, strategy: str = "default", feature_layer: int | list[int] = -2) -> Path:
    import transformers

    tok = _tokenizer(IMAGE_TOKEN)
    text, vision = _llava_parts(tok)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=len(tok) - 1,
                                      vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy,
                                      image_seq_length=TOKENS_PER_IMAGE + (strategy == "full"),
                                      tie_word_embeddings=True)
    torch.manual_seed(7)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    _load_decoder(model, tok, model.model.multi_modal_projector.parameters())
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
    return hf_generate(path, {"input_ids": torch.tensor([ids]), "pixel_values": pixel_values}, max_new_tokens)


def hf_generate(path: Path, enc: dict, max_new_tokens: int) -> list[int]:
    """transformers' greedy new ids for the processor's outputs enc (any of the tiny models)."""
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             pad_token_id=0)
    return out[0, enc["input_ids"].shape[1]:].tolist()


def _text_fields(s, tok) -> dict:
    """The bundled model's decoder fields (config s) as a text_config dict, vocabulary with tok's tokens."""
    return {"vocab_size": len(tok), "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size,
            "num_hidden_layers": s.num_hidden_layers, "num_attention_heads": s.num_attention_heads,
            "num_key_value_heads": s.num_key_value_heads, "max_position_embeddings": 512,
            "rms_norm_eps": s.rms_norm_eps, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": True}


QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN_TEMPLATE = CHAT_TEMPLATE.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")


def save_tiny_qwen_vl(path: Path, version: str = "2") -> Path:
    """A tiny Qwen2-VL (version "2"), Qwen2.5-VL ("2.5") or Qwen3-VL ("3"): a random vision transformer
    (14 px patches, 16 for Qwen3-VL; 2x2 merge) in front of the bundled model's weights as a Qwen2
    decoder (q/k/v biases zero; Qwen3-VL: Qwen3, q/k norms one), with
    M-RoPE sections [1, 2, 1] of its 4 frequencies at rope_theta 10 (so height and width turn enough to
    matter), and the model's image processor (4-16 features per image)."""
    import transformers

    tok = _tokenizer(*QWEN_TOKENS)
    ids = dict(zip(QWEN_TOKENS, tok.convert_tokens_to_ids(list(QWEN_TOKENS))))
    s = transformers.LlamaConfig.from_pretrained(BUNDLED_MODEL)
    text = _text_fields(s, tok) | {
        "rope_parameters": {"rope_type": "default", "rope_theta": 10.0, "mrope_section": [1, 2, 1]}}
    common = {"image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
              "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
              "tie_word_embeddings": True}
    patch = 14
    if version == "2":
        vision = {"depth": 2, "embed_dim": 32, "num_heads": 4, "mlp_ratio": 2, "hidden_size": s.hidden_size,
                  "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
        config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **common)
        model_cls = transformers.Qwen2VLForConditionalGeneration
    elif version == "3":  # a Qwen3 decoder (q/k norms), interleaved sections, deepstack from both tower layers
        patch = 16
        text["head_dim"] = s.head_dim
        text["rope_parameters"] |= {"mrope_interleaved": True}
        vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "out_hidden_size": s.hidden_size,
                  "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 16,
                  "deepstack_visual_indexes": [0, 1]}
        config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **common)
        model_cls = transformers.Qwen3VLForConditionalGeneration
    else:
        vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4, "out_hidden_size": s.hidden_size,
                  "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
                  "fullatt_block_indexes": [1]}
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **common)
        model_cls = transformers.Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(11)
    model = model_cls(config).eval()
    visual = model.model.visual
    _load_decoder(model, tok, [*visual.merger.parameters(),
                               *(p for m in getattr(visual, "deepstack_merger_list", []) for p in m.parameters())])
    model.save_pretrained(path)
    # The image processor and tokenizer, not Qwen2VLProcessor (its video half needs torchvision).
    side = 2 * patch  # pixels per feature
    transformers.Qwen2VLImageProcessor(patch_size=patch, min_pixels=side * side * 4,
                                       max_pixels=side * side * 16).save_pretrained(path)
    tok.chat_template = QWEN_TEMPLATE
    tok.save_pretrained(path)
    return path


def qwen_inputs(path: Path, text: str, pictures: list) -> dict:
    """What Qwen2VLProcessor gives: input_ids with each <|image_pad|> repeated to its image's merged
    patches, pixel_values, image_grid_thw, mm_token_type_ids."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    enc = {"input_ids": tok(text, return_tensors="pt")["input_ids"]}
    if pictures:
        enc |= transformers.AutoImageProcessor.from_pretrained(path)(pictures, return_tensors="pt")
        counts = iter((enc["image_grid_thw"].prod(-1) // 4).tolist())
        ids = [t for i in enc["input_ids"][0].tolist() for t in ([i] * next(counts) if i == pad else [i])]
        enc["input_ids"] = torch.tensor([ids])
    enc["mm_token_type_ids"] = (enc["input_ids"] == pad).int()
    enc["attention_mask"] = torch.ones_like(enc["input_ids"])
    return enc


PIXTRAL_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")


def save_tiny_mistral3(path: Path) -> Path:
    """A tiny Mistral 3: a random Pixtral tower (8 px patches, 2x2 merge: a feature per 16x16 pixels of
    an image up to 64 px) and projector in front of the bundled model's weights as a Mistral decoder."""
    import transformers

    tok = _tokenizer(*PIXTRAL_TOKENS)
    s = transformers.LlamaConfig.from_pretrained(BUNDLED_MODEL)
    text = _text_fields(s, tok) | {"model_type": "mistral", "head_dim": s.head_dim, "sliding_window": None}
    vision = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "head_dim": 8, "image_size": 64, "patch_size": 8}
    config = transformers.Mistral3Config(vision_config=vision, text_config=text,
                                         image_token_index=tok.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
                                         tie_word_embeddings=True)
    torch.manual_seed(13)
    model = transformers.Mistral3ForConditionalGeneration(config).eval()
    projector = model.model.multi_modal_projector
    _load_decoder(model, tok, [projector.linear_1.weight, projector.linear_2.weight])
    model.save_pretrained(path)
    transformers.PixtralImageProcessor(size={"longest_edge": 64}, patch_size=8).save_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE.replace("<image>", "[IMG]")
    tok.save_pretrained(path)
    return path


def mistral3_inputs(path: Path, text: str, pictures: list) -> dict:
    """What PixtralProcessor gives (it needs torchvision): each [IMG] becomes the image's rows of
    [IMG] tokens, one per 16x16 pixels, each row ended by [IMG_BREAK], the last by [IMG_END]."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(path)
    img, brk, end = tok.convert_tokens_to_ids(list(PIXTRAL_TOKENS))
    enc = {"input_ids": tok(text, return_tensors="pt")["input_ids"]}
    if pictures:
        enc |= transformers.AutoImageProcessor.from_pretrained(path)(pictures, return_tensors="pt", patch_size=16)
        sizes = iter(enc["image_sizes"].tolist())
        ids = []
        for t in enc["input_ids"][0].tolist():
            if t == img:
                h, w = next(sizes)
                run = ([img] * (w // 16) + [brk]) * (h // 16)
                ids += run[:-1] + [end]
            else:
                ids.append(t)
        enc["input_ids"] = torch.tensor([ids])
    enc["attention_mask"] = torch.ones_like(enc["input_ids"])
    return enc


def save_tiny_llava_next(path: Path) -> Path:
    """A tiny LLaVA-NeXT: save_tiny_llava's tower (32 px tiles of 16 features) on the grid pinpoints
    32x64, 64x32 and 64x64, a random image_newline, and the model's own LlavaNextProcessor."""
    import transformers

    tok = _tokenizer(IMAGE_TOKEN)
    text, vision = _llava_parts(tok)
    pinpoints = [[32, 64], [64, 32], [64, 64]]
    config = transformers.LlavaNextConfig(vision_config=vision, text_config=text, image_token_index=len(tok) - 1,
                                          image_grid_pinpoints=pinpoints, vision_feature_layer=-2,
                                          vision_feature_select_strategy="default", tie_word_embeddings=True)
    torch.manual_seed(17)
    model = transformers.LlavaNextForConditionalGeneration(config).eval()
    _load_decoder(model, tok, model.model.multi_modal_projector.parameters())
    with torch.no_grad():
        model.model.image_newline.normal_(0, 1)
    model.save_pretrained(path)
    images = transformers.LlavaNextImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32},
                                                  image_grid_pinpoints=pinpoints)
    transformers.LlavaNextProcessor(image_processor=images, tokenizer=tok, patch_size=8,
                                    vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                    chat_template=CHAT_TEMPLATE).save_pretrained(path)
    return path


def hf_next_inputs(path: Path, text: str, pictures: list) -> dict:
    import transformers

    return dict(transformers.AutoProcessor.from_pretrained(path)(text=text, images=pictures or None, return_tensors="pt"))
