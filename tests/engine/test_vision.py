"""Vision-language models (kvrelay.engine.multimodal): a tiny LLaVA's, LLaVA-NeXT's, Qwen2-VL's, Qwen2.5-VL's and
Mistral 3's greedy tokens equal transformers' for prompts with images, through chunked prefill that cuts images, the prefix cache
and preemption; and the checks on what a prompt's images must match."""

from __future__ import annotations

import hashlib

import pytest
import torch
from helpers import make_engine
from kvrelay.engine.errors import InvalidRequestError
from kvrelay.engine.multimodal.inputs import ImageInputs, ImagePrompt
from kvrelay.engine.sampling_params import SamplingParams
from vision_models import (
    TOKENS_PER_IMAGE,
    hf_generate,
    hf_greedy,
    hf_inputs,
    hf_next_inputs,
    image,
    mistral3_inputs,
    qwen_inputs,
    save_tiny_llava,
    save_tiny_llava_next,
    save_tiny_mistral3,
    save_tiny_qwen_vl,
)

from kvrelay.models import BUNDLED_MODEL

TEXT = "user: Once upon a time <image> there was <image> a\nassistant:"
MAX_NEW = 10


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return save_tiny_llava(tmp_path_factory.mktemp("llava"))


def prompt_of(ids, pixel_values) -> ImagePrompt:
    hashes = tuple(hashlib.sha256(p.numpy().tobytes()).hexdigest() for p in pixel_values)
    return ImagePrompt(ids, ImageInputs(pixel_values, hashes))


def run(engine, prompts: list, max_tokens: int = MAX_NEW) -> list[list[int]]:
    """Every prompt submitted at once; each one's generated ids, in order."""
    for i, p in enumerate(prompts):
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), f"r{i}")
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_greedy_equals_transformers_with_images_cut_by_chunks(llava):
    # Two prompts, same text, one image differs: the 16-token budget cuts each image's 16 placeholders
    # across two chunks, and both prompts prefill in the same steps.
    cases = [hf_inputs(llava, TEXT, [image(1), image(2)]), hf_inputs(llava, TEXT, [image(3), image(2)])]
    refs = [hf_greedy(llava, ids, pv, MAX_NEW) for ids, pv in cases]
    assert refs[0] != refs[1]  # the images steer the model: ignoring them could not pass
    assert cases[0][0].count(cases[0][0][-1]) < TOKENS_PER_IMAGE  # sanity: ids end in text
    engine = make_engine(llava, max_num_batched_tokens=16)
    assert engine.vision is not None and engine.vision.cfg.tokens_per_image == TOKENS_PER_IMAGE
    assert run(engine, [prompt_of(*c) for c in cases]) == refs
    assert engine.pool.num_free == engine.pool.num_blocks


def test_prefix_cache_is_shared_only_with_the_same_images(llava):
    a = hf_inputs(llava, TEXT, [image(4), image(5)])
    b = hf_inputs(llava, TEXT, [image(6), image(5)])  # the same ids: only the pixels differ
    refs = [hf_greedy(llava, ids, pv, MAX_NEW) for ids, pv in (a, b)]
    engine = make_engine(llava)
    assert run(engine, [prompt_of(*a)]) == [refs[0]]
    # b's placeholder ids equal a's cached blocks' ids: reusing them would answer a's images.
    assert run(engine, [prompt_of(*b)]) == [refs[1]]
    assert engine.requests == {}
    seqs = engine.make_request(prompt_of(*a), SamplingParams(max_tokens=2), "again")
    engine.add(seqs)
    while engine.has_work():
        engine.step()
    assert seqs[0].num_cached_tokens >= 32  # the same images: their blocks are hits
    # The next turn adds an image: the blocks before it are a's, and hit (placeholders key by image).
    c = hf_inputs(llava, TEXT + " big dog\nuser: and <image> then\nassistant:", [image(4), image(5), image(6)])
    assert c[0][:48] == a[0][:48]
    seqs = engine.make_request(prompt_of(*c), SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), "c")
    engine.add(seqs)
    out = []
    while engine.has_work():
        out += [t for o in engine.step() for t in o.new_token_ids]
    assert seqs[0].num_cached_tokens >= 48 and out == hf_greedy(llava, *c, MAX_NEW)


def test_preempted_sequences_recompute_their_images(llava):
    cases = [hf_inputs(llava, TEXT, [image(10 + i), image(20 + i)]) for i in range(3)]
    refs = [hf_greedy(llava, ids, pv, 24) for ids, pv in cases]
    # 14 blocks of 16 tokens: three 57-token prompts growing to 81 cannot all stay.
    engine = make_engine(llava, num_kv_blocks=14, block_size=16, max_num_batched_tokens=64, max_model_len=128,
                         enable_prefix_caching=False)
    assert run(engine, [prompt_of(*c) for c in cases], max_tokens=24) == refs
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_samples_share_their_images_under_async_scheduling(llava, prefix_caching):
    # n=2: sample 1 reuses sample 0's cached blocks, or (no prefix cache) recomputes from the shared features.
    ids, pv = hf_inputs(llava, TEXT, [image(1), image(2)])
    ref = hf_greedy(llava, ids, pv, MAX_NEW)
    engine = make_engine(llava, async_scheduling=True, enable_prefix_caching=prefix_caching, max_num_batched_tokens=24)
    engine.add_request(prompt_of(ids, pv), SamplingParams(n=2, temperature=0, max_tokens=MAX_NEW, ignore_eos=True), "n2")
    out: dict[int, list[int]] = {0: [], 1: []}
    while engine.has_work():
        for o in engine.step():
            out[o.index] += o.new_token_ids
    assert out == {0: ref, 1: ref}


@pytest.mark.parametrize("strategy,layers", [("full", [-3, -1])])
def test_feature_strategy_and_layers_follow_the_config(tmp_path, strategy, layers):
    path = save_tiny_llava(tmp_path, strategy=strategy, feature_layer=layers)
    ids, pv = hf_inputs(path, TEXT, [image(1), image(2)])
    engine = make_engine(path)
    assert engine.vision.cfg.tokens_per_image == TOKENS_PER_IMAGE + 1  # the class token's feature stays
    assert run(engine, [prompt_of(ids, pv)]) == [hf_greedy(path, ids, pv, MAX_NEW)]


def test_prompts_must_match_their_images(llava):
    engine = make_engine(llava)
    ids, pv = hf_inputs(llava, TEXT, [image(1), image(2)])
    with pytest.raises(InvalidRequestError, match="32 image placeholder tokens.*0 image"):
        engine.add_request(list(ids), SamplingParams(max_tokens=2), "no-images")  # a plain copy: no pixels
    with pytest.raises(InvalidRequestError, match="32 image placeholder tokens.*1 image"):
        engine.add_request(prompt_of(ids, pv[:1]), SamplingParams(max_tokens=2), "one-image")
    with pytest.raises(InvalidRequestError, match="16 image placeholder tokens"):
        engine.add_request(prompt_of(ids[:30], pv), SamplingParams(max_tokens=2), "cut")
    with pytest.raises(InvalidRequestError, match="pixel values of shape"):
        engine.add_request(prompt_of(ids, pv[:, :, :16]), SamplingParams(max_tokens=2), "small")
    text_ids, _ = hf_inputs(llava, "user: Once upon a time\nassistant:", [])
    assert len(run(engine, [text_ids])[0]) == MAX_NEW  # text alone is fine
    assert engine.requests == {} and engine.pool.num_free == engine.pool.num_blocks


def test_text_only_model_refuses_images():
    engine = make_engine(BUNDLED_MODEL)
    assert engine.vision is None
    ids = engine.tokenizer.encode_prompt("Once upon a time")
    with pytest.raises(InvalidRequestError, match="takes text only"):
        engine.add_request(ImagePrompt(ids, ImageInputs(image_pixels(), ("x",))), SamplingParams(max_tokens=2), "x")


def image_pixels():
    return torch.zeros(1, 3, 32, 32)


@pytest.mark.parametrize("settings,message", [
    ({"speculative_method": "draft", "speculative_model": str(BUNDLED_MODEL), "num_speculative_tokens": 2},
     "a draft model"),
    ({"enable_lora": True}, "LoRA"),
    ({"distributed_executor_backend": "mp"}, "parallelism"),
])
def test_unsupported_settings_are_refused_at_start(llava, settings, message):
    with pytest.raises(ValueError, match=f"vision-language model.*{message}"):
        make_engine(llava, **settings)


# ---- Qwen2-VL and Qwen2.5-VL: a variable number of features per image, M-RoPE positions -------------

QWEN_TEXT = ("user: Once upon a time <|vision_start|><|image_pad|><|vision_end|> there was "
             "<|vision_start|><|image_pad|><|vision_end|> a\nassistant:")
SIZES = [(60, 90), (100, 50)]  # 6 and 8 features: grids (1, 6, 4) and (1, 4, 8) (Qwen3-VL, 16 px patches: 6 and 6)


@pytest.fixture(scope="module", params=["2", "2.5", "3"])
def qwen_vl(request, tmp_path_factory):
    return save_tiny_qwen_vl(tmp_path_factory.mktemp(f"qwen{request.param}-vl"), request.param)


def qwen_prompt(enc) -> ImagePrompt:
    pv, grid = enc["pixel_values"], enc["image_grid_thw"]
    hashes = tuple(hashlib.sha256(p.numpy().tobytes()).hexdigest() for p in pv.split(grid.prod(-1).tolist()))
    return ImagePrompt(enc["input_ids"][0].tolist(), ImageInputs(pv, hashes, grid))


def test_qwen_vl_greedy_equals_transformers(qwen_vl):
    cases = [qwen_inputs(qwen_vl, QWEN_TEXT, [image(1, SIZES[0]), image(2, SIZES[1])]),
             qwen_inputs(qwen_vl, QWEN_TEXT, [image(3, SIZES[0]), image(2, SIZES[1])])]
    refs = [hf_generate(qwen_vl, enc, MAX_NEW) for enc in cases]
    assert refs[0] != refs[1]
    # 16-token chunks cut the images; the second prompt's ids equal the first's (no cache reuse).
    engine = make_engine(qwen_vl, max_num_batched_tokens=16)
    assert engine.config.mrope_section == (1, 2, 1) and engine.config.mrope_interleaved == (qwen_vl.name.startswith("qwen3"))
    assert run(engine, [qwen_prompt(cases[0])]) == [refs[0]]
    assert run(engine, [qwen_prompt(cases[1])]) == [refs[1]]
    # Text alone rotates as plain rope (its three positions are equal).
    text = qwen_inputs(qwen_vl, "user: Once upon a time\nassistant:", [])
    assert run(engine, [text["input_ids"][0].tolist()]) == [hf_generate(qwen_vl, text, MAX_NEW)]


def test_qwen_vl_preempted_sequences_recompute_their_positions(qwen_vl):
    cases = [qwen_inputs(qwen_vl, QWEN_TEXT, [image(10 + i, SIZES[i % 2]), image(20 + i, SIZES[1 - i % 2])])
             for i in range(3)]
    refs = [hf_generate(qwen_vl, enc, 40) for enc in cases]
    # 8 blocks of 16 tokens: three 43-token prompts growing to 83 cannot all stay.
    engine = make_engine(qwen_vl, num_kv_blocks=8, block_size=16, max_num_batched_tokens=64, max_model_len=128,
                         enable_prefix_caching=False, async_scheduling=True)
    assert run(engine, [qwen_prompt(c) for c in cases], max_tokens=40) == refs
    assert engine.scheduler.num_preemptions > 0


def test_qwen_vl_images_need_their_grids(qwen_vl):
    engine = make_engine(qwen_vl)
    enc = qwen_inputs(qwen_vl, QWEN_TEXT, [image(1, SIZES[0]), image(2, SIZES[1])])
    ids, pv = enc["input_ids"][0].tolist(), enc["pixel_values"]
    with pytest.raises(InvalidRequestError, match="patch grids"):
        engine.add_request(ImagePrompt(ids, ImageInputs(pv, ("x", "y"))), SamplingParams(max_tokens=2), "no-grid")
    with pytest.raises(InvalidRequestError, match=r"holds 6 image placeholder tokens.*take \d+ \(6, \d+\)"):
        engine.add_request(ImagePrompt(ids[:-20], ImageInputs(pv, ("x", "y"), enc["image_grid_thw"])),
                           SamplingParams(max_tokens=2), "cut")


def test_the_tower_runs_when_a_chunk_reaches_the_images(llava):
    ids, pv = hf_inputs(llava, TEXT, [image(1), image(2)])
    engine = make_engine(llava, max_num_batched_tokens=4)  # the first chunk ends before the first image
    (seq,) = engine.make_request(prompt_of(ids, pv), SamplingParams(temperature=0, max_tokens=MAX_NEW,
                                                                     ignore_eos=True), "late")
    engine.add([seq])
    engine.step()
    assert seq.num_computed == 4 < int(seq.images.positions[0]) and seq.images.embeds is None
    out = []
    while engine.has_work():
        out += [t for o in engine.step() for t in o.new_token_ids]
    assert seq.images.embeds is not None and out == hf_greedy(llava, ids, pv, MAX_NEW)


# ---- Mistral 3: the Pixtral tower, images of any size, rows of features ended by [IMG_BREAK] ----------

def sized_prompts(cases: list[dict]) -> list[ImagePrompt]:
    """ImagePrompts of processor outputs whose images carry their sizes (Mistral 3, LLaVA-NeXT)."""
    return [ImagePrompt(enc["input_ids"][0].tolist(), ImageInputs(enc["pixel_values"], (f"{k}a", f"{k}b"), None,
                                                                  enc["image_sizes"]))
            for k, enc in enumerate(cases)]


def test_mistral3_greedy_equals_transformers(tmp_path):
    path = save_tiny_mistral3(tmp_path / "mistral3")
    text = "user: Once upon a time [IMG] there was [IMG] a\nassistant:"
    cases = [mistral3_inputs(path, text, [image(1, (40, 56)), image(2, (70, 30))]),  # 12 and 8 features
             mistral3_inputs(path, text, [image(3, (64, 64)), image(4, (30, 20))])]  # 16 and 2
    refs = [hf_generate(path, enc, MAX_NEW) for enc in cases]
    # Both at once: one run of the tower over both prompts' images, padded to one size.
    engine = make_engine(path, max_num_batched_tokens=16)
    prompts = sized_prompts(cases)
    assert run(engine, prompts) == refs
    with pytest.raises(InvalidRequestError, match="image_sizes"):
        engine.add_request(ImagePrompt(prompts[0], ImageInputs(cases[0]["pixel_values"], ("x", "y"))),
                           SamplingParams(max_tokens=2), "no-sizes")


def test_llava_next_greedy_equals_transformers(tmp_path):
    # LLaVA-NeXT: each image tiled at its best pinpoint; its count follows its size (92 features here).
    path = save_tiny_llava_next(tmp_path / "llava-next")
    cases = [hf_next_inputs(path, TEXT, [image(1, (40, 70)), image(2, (30, 30))]),
             hf_next_inputs(path, TEXT, [image(3, (70, 40)), image(4, (64, 20))])]
    refs = [hf_generate(path, enc, MAX_NEW) for enc in cases]
    engine = make_engine(path, max_num_batched_tokens=16)
    assert run(engine, sized_prompts(cases)) == refs  # both at once: one tower run over every tile


def test_ngram_speculation_with_images_is_lossless(llava, qwen_vl):
    """--speculative-method ngram: verification rows beside prefill chunks with images, and (Qwen-VL)
    M-RoPE positions on every verified row; tokens equal transformers' greedy ones."""
    cases = [(llava, prompt_of(*hf_inputs(llava, TEXT, [image(1), image(2)])), None),
             (qwen_vl, None, qwen_inputs(qwen_vl, QWEN_TEXT, [image(1, SIZES[0]), image(2, SIZES[1])]))]
    for path, prompt, enc in cases:
        ref = hf_greedy(path, list(prompt), prompt.images.pixel_values, 40) if enc is None else \
            hf_generate(path, enc, 40)
        prompt = prompt if enc is None else qwen_prompt(enc)
        engine = make_engine(path, speculative_method="ngram", num_speculative_tokens=3, max_num_batched_tokens=16,
                             speculative_adaptive=False)
        # A second request arrives while the first decodes: its image chunks share steps with verification.
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), "a")
        out: dict[str, list[int]] = {"a": [], "b": []}
        added = False
        while engine.has_work():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
            if not added and len(out["a"]) >= 4:
                engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), "b")
                added = True
        assert out == {"a": ref, "b": ref}
        assert engine.speculator.stats.num_draft_tokens > 0  # proposals were verified (accepted or not)
