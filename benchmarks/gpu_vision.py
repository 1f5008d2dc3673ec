"""The device script's vision row (benchmarks/gpu_engine.py, parity section): a tiny LLaVA's greedy
tokens with images, on the device (graphs on; steps with image rows run eagerly, in 24-token chunks
that cut the images) against CPU torch. Built without Pillow (the device machine has none): random
pixel values stand in for processed images.

The model: a random CLIP tower (32 px, 8 px patches: 16 features per image) and projector in front
of the bundled stories260K decoder, whose last vocabulary id stands for the image.
"""

from __future__ import annotations

import shutil
from pathlib import Path

IMAGE_TOKEN = 511  # the bundled vocabulary's last id
TOKENS_PER_IMAGE = 16


def save_device_llava(path: Path) -> Path:
    import torch
    import transformers

    from kvrelay.models import BUNDLED_MODEL

    decoder = transformers.LlamaForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=32, patch_size=8)
    config = transformers.LlavaConfig(vision_config=vision, text_config=decoder.config, image_token_index=IMAGE_TOKEN,
                                      image_seq_length=TOKENS_PER_IMAGE, tie_word_embeddings=True)
    torch.manual_seed(3)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    model.model.language_model.load_state_dict(decoder.model.state_dict())
    with torch.no_grad():  # larger projector weights: the images visibly steer the decoder
        for p in model.model.multi_modal_projector.parameters():
            p.mul_(8)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(BUNDLED_MODEL / name, path / name)
    return path


def image_prompts(texts: list[str], seed: int) -> list:
    """Each text, one image's placeholders, then " and then": ImagePrompts with random pixels."""
    import torch
    from kvrelay.engine.multimodal.inputs import ImageInputs, ImagePrompt
    from kvrelay.engine.tokenizer import Tokenizer

    from kvrelay.models import BUNDLED_MODEL

    tok = Tokenizer(BUNDLED_MODEL)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k, text in enumerate(texts):
        ids = tok.encode_prompt(text) + [IMAGE_TOKEN] * TOKENS_PER_IMAGE + tok.encode_plain(" and then", False)
        pixels = torch.randn(1, 3, 32, 32, generator=gen)
        out.append(ImagePrompt(ids, ImageInputs(pixels, (f"{seed}-{k}",))))
    return out


def parity_vision(rep, device: str, engine_for, greedy_tokens, texts: list[str], tmp: Path) -> None:
    n = 24
    path = save_device_llava(tmp / "llava")
    prompts, others = image_prompts(texts, 0), image_prompts(texts, 1)
    want = greedy_tokens(engine_for(path, "cpu", kernel_backend="torch"), prompts, n)
    changed = sum(a != b for a, b in zip(want, greedy_tokens(engine_for(path, "cpu", kernel_backend="torch"),
                                                              others, n)))
    engine = engine_for(path, device, kv_cache_memory=64 * 2**20, max_num_seqs=16, max_num_batched_tokens=24)
    got = greedy_tokens(engine, prompts, n)
    same = sum(g == w for g, w in zip(got, want))
    rep.add("parity_vision", {"identical": same, "of": len(texts), "images_changed": changed,
                              "graph_steps": engine.runner.graph_steps},
            f"parity tiny LLaVA greedy with an image per prompt, {device}: {same}/{len(texts)} identical to CPU "
            f"torch (other images changed {changed}/{len(texts)} outputs; {engine.runner.graph_steps} graph steps)")
