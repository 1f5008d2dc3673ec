"""Image-chat throughput: kvrelay's engine (continuous batching, chunked prefill over the image's
placeholders, paged K/V) against transformers' LlavaForConditionalGeneration.generate on the same
weights, images and prompts, in left-padded batches and one request at a time.

    .venv/bin/python benchmarks/vision.py [--requests 16] [--batch 8] [--max-tokens 32] [--rounds 2]

The model: a ViT-S/16-shaped CLIP tower (224 px, 196 features per image, 6 layers, hidden 384) and
a ~30M-parameter Llama decoder (random weights, fp32). Each request: 16-64 random text tokens with
one random 256x256 image inside, 32 new tokens (ignore_eos). Each system runs in turn, rounds
times; figures are medians, ratios against HF's padded batches in the same run. kvrelay's greedy
tokens are checked against HF's first.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import LLAMA_30M, write_word_tokenizer

IMAGE_TOKEN = LLAMA_30M["vocab_size"] - 1
TOWER = {"hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 6, "num_attention_heads": 6,
         "image_size": 224, "patch_size": 16, "projection_dim": 384}


def make_llava(path: Path) -> Path:
    import torch
    import transformers

    text = transformers.LlamaConfig(**{k: v for k, v in LLAMA_30M.items() if k != "architectures"})
    config = transformers.LlavaConfig(vision_config=transformers.CLIPVisionConfig(**TOWER), text_config=text,
                                      image_token_index=IMAGE_TOKEN, image_seq_length=196)
    torch.manual_seed(0)
    transformers.LlavaForConditionalGeneration(config).save_pretrained(path)
    transformers.CLIPImageProcessor(size={"shortest_edge": 224},
                                    crop_size={"height": 224, "width": 224}).save_pretrained(path)
    write_word_tokenizer(path, LLAMA_30M["vocab_size"])
    return path


def make_requests(n: int, path: Path, seed: int = 7):
    """(ids with the image's 196 placeholders, pixel_values [1, 3, 224, 224]) per request."""
    import numpy as np
    import transformers
    from PIL import Image

    rng = random.Random(seed)
    processor = transformers.AutoImageProcessor.from_pretrained(path)
    out = []
    for k in range(n):
        before = [rng.randrange(3, IMAGE_TOKEN) for _ in range(rng.randint(8, 32))]
        after = [rng.randrange(3, IMAGE_TOKEN) for _ in range(rng.randint(8, 32))]
        picture = Image.fromarray(np.random.default_rng(k).integers(0, 256, (256, 256, 3), dtype=np.uint8))
        pixels = processor(picture, return_tensors="pt")["pixel_values"]
        out.append(([1, *before, *[IMAGE_TOKEN] * 196, *after], pixels))
    return out


def run_kvrelay(engine, requests, max_tokens: int):
    """(seconds, each request's tokens, seconds of them in the vision tower)."""
    from kvrelay.engine.multimodal.inputs import ImageInputs, ImagePrompt
    from kvrelay.engine.sampling_params import SamplingParams

    tower, in_tower = engine.vision, [0.0]

    def timed(images):  # the tower's share of the run (the same transformers module as HF's)
        t0 = time.perf_counter()
        try:
            return type(tower).encode_many(tower, images)
        finally:
            in_tower[0] += time.perf_counter() - t0

    tower.encode_many = timed
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    try:
        for k, (ids, pixels) in enumerate(requests):
            digest = hashlib.sha256(pixels.numpy().tobytes()).hexdigest()
            engine.add_request(ImagePrompt(ids, ImageInputs(pixels, (digest,))),
                               SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), f"r{k}")
            tokens[f"r{k}"] = []
        while engine.has_work():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
    finally:
        del tower.encode_many
    return time.perf_counter() - start, [tokens[f"r{k}"] for k in range(len(requests))], in_tower[0]


def run_hf(model, requests, batch: int, max_tokens: int):
    """Left-padded batches with an attention mask, greedy."""
    import torch

    out = []
    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(requests), batch):
            chunk = requests[b : b + batch]
            width = max(len(ids) for ids, _ in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for r, (p, _) in enumerate(chunk):
                ids[r, width - len(p):] = torch.tensor(p)
                mask[r, width - len(p):] = 1
            pixels = torch.cat([px for _, px in chunk])
            gen = model.generate(input_ids=ids, attention_mask=mask, pixel_values=pixels, do_sample=False,
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0)
            out += gen[:, width:].tolist()
    return time.perf_counter() - start, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8, help="HF's padded batch size")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    import torch
    import transformers
    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.engine.llm_engine import LLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        path = make_llava(Path(tmp) / "llava")
        requests = make_requests(args.requests, path)
        engine = LLMEngine(EngineArgs(model=str(path), max_num_seqs=args.requests, enable_prefix_caching=False))
        hf = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
        _, ours, _ = run_kvrelay(engine, requests[:2], 8)  # warm-up, and the check (one request per HF batch)
        _, ref = run_hf(hf, requests[:2], 1, 8)
        print(f"greedy tokens equal to HF's on 2 requests: {ours == ref}")
        if ours != ref:
            raise SystemExit("MISMATCH: kvrelay's tokens differ from transformers'")
        names = ["kvrelay", f"HF padded batches of {args.batch}", "HF one at a time"]
        times: dict[str, list[float]] = {n: [] for n in names}
        tower: list[float] = []
        for _ in range(args.rounds):
            seconds, _, in_tower = run_kvrelay(engine, requests, args.max_tokens)
            times[names[0]].append(seconds)
            tower.append(in_tower)
            times[names[1]].append(run_hf(hf, requests, args.batch, args.max_tokens)[0])
            times[names[2]].append(run_hf(hf, requests, 1, args.max_tokens)[0])
    generated = args.requests * args.max_tokens
    base = statistics.median(times[names[1]])
    print(f"{args.requests} requests of one image (196 placeholders) and 17-65 text tokens, {args.max_tokens} new "
          f"tokens each, median of {args.rounds} rounds, torch threads {torch.get_num_threads()}")
    print("| system | requests/s | output tok/s | vs HF padded |\n|---|---:|---:|---:|")
    rows = {}
    for name, ts in times.items():
        t = statistics.median(ts)
        rows[name] = {"seconds": t, "requests_per_s": args.requests / t, "output_tokens_per_s": generated / t}
        print(f"| {name} | {args.requests / t:.2f} | {generated / t:,.0f} | {base / t:.2f}x |")
    print(f"kvrelay's vision tower: {statistics.median(tower):.2f} s of its {statistics.median(times[names[0]]):.2f} s")
    rows["kvrelay"]["tower_seconds"] = statistics.median(tower)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
