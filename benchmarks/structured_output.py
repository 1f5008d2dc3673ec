"""Structured output overhead: decode tokens/s with a json_schema constraint against unconstrained
decoding, measured in the same run, at batch 1 and 32.

    .venv/bin/python benchmarks/structured_output.py [--tokens 64] [--batches 1,32] [--vocab 0,32000]
        [--repeats 3]

Both runs generate exactly --tokens tokens per sequence (sampled at temperature 1.0, seeded): the
schema is an unbounded array of strings, which never ends within them (string content allows
nearly every token: the widest masks llguidance computes; minItems 1000 keeps it open). `--vocab 0` is the bundled stories260K
(512 tokens); another size is a byte-level BPE tokenizer of that size trained here on the Python
standard library's source, with a random-weights Llama (hidden 256, 4 layers) on top, so the mask
costs what it does for a real vocabulary. Prints tokens/s of both and their ratio, and the mask's own
time per step (filling and applying the bitmask), which a loaded machine disturbs less than tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

SCHEMA = {"type": "array", "items": {"type": "string"}, "minItems": 1000}


def build_model(vocab: int, root: Path) -> Path:
    """A random-weights Llama with a trained BPE tokenizer of `vocab` tokens."""
    import sysconfig

    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = root / f"llama-v{vocab}"
    folder.mkdir()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    files = sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    tok.train(files, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=256, intermediate_size=512,
                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                             torch_dtype="float32", architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    return folder


MASK_TIME = [0.0, 0]  # seconds in the mask, steps


def _timed_mask() -> None:
    from kvrelay.engine import sampler

    apply = sampler.grammar_mask.apply

    def timed(*args):
        start = time.perf_counter()
        apply(*args)
        MASK_TIME[0] += time.perf_counter() - start
        MASK_TIME[1] += 1

    sampler.grammar_mask.apply = timed


def run_once(model: str, load_format: str, batch: int, tokens: int, constrained: bool) -> float:
    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.engine.llm_engine import LLMEngine
    from kvrelay.engine.sampling_params import SamplingParams
    from kvrelay.engine.structured.spec import GuidedSpec

    engine = LLMEngine(EngineArgs(model=model, load_format=load_format, max_num_seqs=max(batch, 8)))
    spec = GuidedSpec("json", json.dumps(SCHEMA)) if constrained else None
    engine.grammars.get(spec) if spec else None  # compiled before the clock starts (AsyncEngine does it off-thread)

    def params(seed: int, n: int):
        return SamplingParams(max_tokens=n, temperature=1.0, seed=seed, ignore_eos=True, structured=spec)

    engine.add_request("Once upon a time", params(0, 4), "warm-up")
    while engine.has_work():
        engine.step()
    for i in range(batch):
        engine.add_request("Once upon a time", params(i, tokens), str(i))
    generated = 0
    MASK_TIME[:] = [0.0, 0]
    start = time.perf_counter()
    while engine.has_work():
        generated += sum(len(o.new_token_ids) for o in engine.step())
    seconds = time.perf_counter() - start
    assert generated == batch * tokens, (generated, batch * tokens)
    return generated / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--vocab", default="0,32000", help="0: stories260K; else a trained BPE vocabulary size")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from kvrelay.models import BUNDLED_MODEL

    _timed_mask()
    with tempfile.TemporaryDirectory() as tmp:
        for vocab in (int(v) for v in args.vocab.split(",")):
            model, fmt = (str(BUNDLED_MODEL), "auto") if vocab == 0 else (str(build_model(vocab, Path(tmp))), "dummy")
            name = "stories260K (vocab 512)" if vocab == 0 else f"random Llama, BPE vocab {vocab}"
            for batch in (int(b) for b in args.batches.split(",")):
                plain, guided, mask_ms = [], [], []
                for _ in range(args.repeats):  # interleaved, so drifting machine load hits both alike
                    plain.append(run_once(model, fmt, batch, args.tokens, False))
                    guided.append(run_once(model, fmt, batch, args.tokens, True))
                    mask_ms.append(MASK_TIME[0] / MASK_TIME[1] * 1e3)
                p, g = statistics.median(plain), statistics.median(guided)
                step_ms = batch / g * 1e3
                print(f"{name:34s} batch {batch:3d}: unconstrained {p:8.1f} tok/s, json_schema {g:8.1f} tok/s, "
                      f"ratio {g / p:.2f}x; mask {statistics.median(mask_ms):.3f} ms of a {step_ms:.1f} ms step",
                      flush=True)


if __name__ == "__main__":
    sys.exit(main())
