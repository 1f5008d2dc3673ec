"""The speculative-decoding case of benchmarks/gpu_engine.py (section `spec`): a 1B-shape target,
greedy, batch 1 and 16, without speculation, with the target as its own draft (every proposal is
accepted: the mechanism's cost with perfect acceptance) and with a 2-layer draft cut from the
target (random weights: low acceptance, the cost of rejections). Same-run ratios against plain."""

from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path


def truncated_copy(src: Path, dst: Path, layers: int) -> Path:
    """src's first `layers` decoder layers, its embedding, norm and head: a draft with its vocabulary."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (dst / "config.json").write_text(json.dumps(config))
    (dst / "model.safetensors.index.json").unlink(missing_ok=True)
    keep = {}
    for shard in src.glob("*.safetensors"):
        keep |= {k: v for k, v in load_file(shard).items()
                 if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def section_spec(rep, model_dir: Path, vocab: int, device: str, smoke: bool, engine_kw: dict) -> None:
    import torch
    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.engine.llm_engine import LLMEngine
    from kvrelay.engine.sampling_params import SamplingParams

    draft_dir = truncated_copy(model_dir, model_dir.parent / "draft-2l", 2)
    rng = random.Random(1)
    tokens = 16 if smoke else 128
    base = {"speculative_adaptive": False, "num_speculative_tokens": 4}
    modes = {"plain": {}, "draft=target": base | {"speculative_method": "draft", "speculative_model": str(model_dir)},
             "2-layer draft": base | {"speculative_method": "draft", "speculative_model": str(draft_dir)}}
    for batch in (1, 16):
        prompts = [[rng.randrange(3, vocab) for _ in range(64)] for _ in range(batch)]
        results = {}
        for mode, kw in modes.items():
            engine = LLMEngine(EngineArgs(model=str(model_dir), device=device, **engine_kw, **kw))
            params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(prompts[0][:8], SamplingParams(max_tokens=4, temperature=0.0), "warm")
            while engine.has_work():
                engine.step()
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for i, p in enumerate(prompts):
                engine.add_request(p, params, str(i))
            out: dict[str, list[int]] = {}
            while engine.has_work():
                for o in engine.step():
                    out.setdefault(o.request_id, []).extend(o.new_token_ids)
            seconds = time.perf_counter() - start
            s = engine.stats()
            results[mode] = (out, batch * tokens / seconds, s.spec_num_accepted_tokens, s.spec_num_draft_tokens)
            del engine
            if device == "cuda":
                torch.cuda.empty_cache()
        plain_out, plain_rate = results["plain"][:2]
        for mode, (out, rate, accepted, proposed) in results.items():
            accept = f", acceptance {accepted / proposed:.2f}" if proposed else ""
            rep.add(f"spec_{mode}_b{batch}", rate,
                    f"speculative {mode}, batch {batch}: {rate:,.0f} tok/s, {rate / plain_rate:.2f}x plain"
                    f"{accept}, identical to plain: {out == plain_out}")
