"""The device script's vision rows (benchmarks/gpu_engine.py, parity section): a tiny LLaVA's,
Qwen2-VL's and Mistral 3's greedy tokens with images, on the device (graphs on; steps with image rows run
eagerly, in 24-token chunks that cut the images; Qwen2-VL's decode graphs replay M-RoPE positions)
against CPU torch. Built without Pillow (the device machine has none): random pixel values stand in
for processed images.

The models: random vision towers in front of the bundled stories260K decoder, whose last vocabulary
id stands for the image.
"""

from __future__ import annotations

import shutil
from pathlib import Path

IMAGE_TOKEN = 511  # the bundled vocabulary's last id
TOKENS_PER_IMAGE = 16


def _save(model, path: Path, boosted) -> Path:
    """Save model with the bundled tokenizer, the boosted weights times 8 first (so that the images
    visibly steer the decoder)."""
    import torch

    from kvrelay.models import BUNDLED_MODEL

    with torch.no_grad():
        for p in boosted:
            p.mul_(8)
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(BUNDLED_MODEL / name, path / name)
    return path


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
    return _save(model, path, model.model.multi_modal_projector.parameters())


def save_device_qwen_vl(path: Path) -> Path:
    """A tiny Qwen2-VL: a random vision transformer (14 px patches, 2x2 merge) in front of the bundled
    decoder's weights as Qwen2 (q/k/v biases zero), M-RoPE sections [1, 2, 1] at rope_theta 10."""
    import torch
    import transformers

    from kvrelay.models import BUNDLED_MODEL

    stories = transformers.LlamaForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32)
    s = stories.config
    text = {"vocab_size": s.vocab_size, "hidden_size": s.hidden_size, "intermediate_size": s.intermediate_size,
            "num_hidden_layers": s.num_hidden_layers, "num_attention_heads": s.num_attention_heads,
            "num_key_value_heads": s.num_key_value_heads, "max_position_embeddings": 512, "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10.0, "mrope_section": [1, 2, 1]}}
    vision = {"depth": 2, "embed_dim": 32, "num_heads": 4, "mlp_ratio": 2, "hidden_size": s.hidden_size,
              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
    config = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN,
                                        video_token_id=IMAGE_TOKEN - 1, vision_start_token_id=IMAGE_TOKEN - 2,
                                        vision_end_token_id=IMAGE_TOKEN - 3, tie_word_embeddings=True)
    torch.manual_seed(5)
    model = transformers.Qwen2VLForConditionalGeneration(config).eval()
    state = stories.model.state_dict()
    with torch.no_grad():
        for name, p in model.model.language_model.named_parameters():
            p.copy_(state[name] if name in state else torch.zeros_like(p))
    return _save(model, path, model.model.visual.merger.parameters())


def save_device_mistral3(path: Path) -> Path:
    """A tiny Mistral 3: a random Pixtral tower (8 px patches, 2x2 merge) and projector in front of
    the bundled decoder's weights as Mistral."""
    import torch
    import transformers

    from kvrelay.models import BUNDLED_MODEL

    stories = transformers.LlamaForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32)
    s = stories.config
    text = {"model_type": "mistral", "vocab_size": s.vocab_size, "hidden_size": s.hidden_size,
            "intermediate_size": s.intermediate_size, "num_hidden_layers": s.num_hidden_layers,
            "num_attention_heads": s.num_attention_heads, "num_key_value_heads": s.num_key_value_heads,
            "head_dim": s.head_dim, "max_position_embeddings": 512, "tie_word_embeddings": True, "sliding_window": None}
    vision = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "head_dim": 8, "image_size": 64, "patch_size": 8}
    config = transformers.Mistral3Config(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                                         spatial_merge_size=2, tie_word_embeddings=True)
    torch.manual_seed(7)
    model = transformers.Mistral3ForConditionalGeneration(config).eval()
    model.model.language_model.load_state_dict(stories.model.state_dict())
    projector = model.model.multi_modal_projector
    return _save(model, path, [projector.linear_1.weight, projector.linear_2.weight])


def _prompts(texts: list[str], seed: int, run: list[int], pixel_shape: tuple[int, ...], **sizes) -> list:
    """Each text, one image's run of tokens, then " and then": ImagePrompts with random pixels (sizes:
    ImageInputs' grid_thw or image_sizes)."""
    import torch
    from kvrelay.engine.multimodal.inputs import ImageInputs, ImagePrompt
    from kvrelay.engine.tokenizer import Tokenizer

    from kvrelay.models import BUNDLED_MODEL

    tok = Tokenizer(BUNDLED_MODEL)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k, text in enumerate(texts):
        ids = tok.encode_prompt(text) + run + tok.encode_plain(" and then", False)
        pixels = torch.randn(*pixel_shape, generator=gen)
        out.append(ImagePrompt(ids, ImageInputs(pixels, (f"{seed}-{k}",), **sizes)))
    return out


def image_prompts(texts: list[str], seed: int) -> list:
    """LLaVA: a 32x32 image, 16 features."""
    return _prompts(texts, seed, [IMAGE_TOKEN] * TOKENS_PER_IMAGE, (1, 3, 32, 32))


def qwen_prompts(texts: list[str], seed: int) -> list:
    """Qwen2-VL: an image of a (1, 4, 6) patch grid, 6 features."""
    import torch

    return _prompts(texts, seed, [IMAGE_TOKEN] * 6, (24, 3 * 2 * 14 * 14), grid_thw=torch.tensor([[1, 4, 6]]))


def pixtral_prompts(texts: list[str], seed: int) -> list:
    """Mistral 3: a 32x48 image, 2 rows of 3 features, each row ended by another id."""
    import torch

    run = [IMAGE_TOKEN] * 3 + [IMAGE_TOKEN - 1] + [IMAGE_TOKEN] * 3 + [IMAGE_TOKEN - 2]
    return _prompts(texts, seed, run, (1, 3, 32, 48), image_sizes=torch.tensor([[32, 48]]))


def parity_vision(rep, device: str, engine_for, greedy_tokens, texts: list[str], tmp: Path) -> None:
    """Rows parity_vision (LLaVA), parity_vision_mrope (Qwen2-VL: decode graphs replay M-RoPE
    positions) and parity_vision_pixtral (Mistral 3)."""
    n = 24
    for row, name, path, make in (("parity_vision", "LLaVA", save_device_llava(tmp / "llava"), image_prompts),
                                  ("parity_vision_mrope", "Qwen2-VL", save_device_qwen_vl(tmp / "qwen"), qwen_prompts),
                                  ("parity_vision_pixtral", "Mistral 3", save_device_mistral3(tmp / "mistral3"),
                                   pixtral_prompts)):
        prompts, others = make(texts, 0), make(texts, 1)
        want = greedy_tokens(engine_for(path, "cpu", kernel_backend="torch"), prompts, n)
        changed = sum(a != b for a, b in zip(want, greedy_tokens(engine_for(path, "cpu", kernel_backend="torch"),
                                                                  others, n)))
        engine = engine_for(path, device, kv_cache_memory=64 * 2**20, max_num_seqs=16, max_num_batched_tokens=24)
        got = greedy_tokens(engine, prompts, n)
        same = sum(g == w for g, w in zip(got, want))
        rep.add(row, {"identical": same, "of": len(texts), "images_changed": changed,
                      "graph_steps": engine.runner.graph_steps},
                f"parity tiny {name} greedy with an image per prompt, {device}: {same}/{len(texts)} identical to CPU "
                f"torch (other images changed {changed}/{len(texts)} outputs; {engine.runner.graph_steps} graph steps)")
