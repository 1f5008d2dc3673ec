"""The `moe` section of benchmarks/gpu_engine.py: a Mixtral-shaped model (8 experts, top-2, random
bf16 weights) through the engine on the Triton kernels.

- parity: greedy tokens with decode CUDA graphs (the fused MoE op captured: its sort and padding
  read nothing back to the host) against --enforce-eager, and against the torch backend (the
  reference MoE) on the same device;
- throughput: requests of random ids, EOS ignored, kvrelay with graphs against the torch backend
  (per-expert reference loop) on the same weights;
- expert load: the imbalance the counters report after the run;
- fp8 (--quantization fp8: W8A8 experts and projections): the Triton fp8 path against the torch
  backend's fp8 reference on the same device (parity and tok/s beside the bf16 rows).
"""

from __future__ import annotations

import gc
import json
import random
import tempfile
import time
from pathlib import Path

from common import write_word_tokenizer

MIXTRAL_GPU = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 2048,
    "intermediate_size": 4096, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 1e6, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}
TINY_MOE = MIXTRAL_GPU | {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                          "max_position_embeddings": 256, "torch_dtype": "float32"}


def _engine(model_dir: Path, device: str, **kw):
    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.engine.llm_engine import LLMEngine

    return LLMEngine(EngineArgs(model=str(model_dir), device=device, load_format="dummy", **kw))


def _run(engine, reqs, tag: str) -> tuple[dict[str, list[int]], float]:
    from kvrelay.engine.sampling_params import SamplingParams

    start = time.perf_counter()
    for i, (ids, n) in enumerate(reqs):
        engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), f"{tag}{i}")
    out: dict[str, list[int]] = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id.removeprefix(tag), []).extend(o.new_token_ids)
    return out, time.perf_counter() - start


def section_moe(rep, device: str, smoke: bool) -> None:
    import torch

    config = TINY_MOE if smoke else MIXTRAL_GPU
    vocab = config["vocab_size"]
    rng = random.Random(0)
    n, prompt_range, out_range = (4, (4, 30), (2, 6)) if smoke else (64, (32, 512), (32, 128))
    reqs = [([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*out_range))
            for _ in range(n)]
    kw = {"kv_cache_memory": 64 * 2**20, "max_num_seqs": 16} if smoke else {"gpu_memory_utilization": 0.6}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp)
        (model_dir / "config.json").write_text(json.dumps(config))
        write_word_tokenizer(model_dir, vocab)
        results = {}
        modes = {"triton eager": {"kernel_backend": "triton", "enforce_eager": True},
                 "torch": {"kernel_backend": "torch", "enforce_eager": True}}
        if not smoke:
            modes = {"triton graphs": {"kernel_backend": "triton"}} | modes
        fp8 = {"quantization": "fp8"}
        fp8_modes = {"fp8 torch": {"kernel_backend": "torch", "enforce_eager": True} | fp8,
                     "fp8 triton eager": {"kernel_backend": "triton", "enforce_eager": True} | fp8}
        if not smoke:
            fp8_modes["fp8 triton graphs"] = {"kernel_backend": "triton"} | fp8
        modes |= fp8_modes
        for name, extra in modes.items():
            engine = _engine(model_dir, device, **kw, **extra)
            if not smoke:  # the interpreter compiles nothing: no warm-up on CPU
                _run(engine, reqs[:2], "warm")  # compiles the kernels outside the measurement
            tokens, seconds = _run(engine, reqs, "r")
            generated = sum(len(t) for t in tokens.values())
            load = engine.model.expert_load()
            results[name] = tokens
            rep.add(f"moe_{name.replace(' ', '_')}", {"tok_s": generated / seconds,
                                                      "imbalance": load.total_imbalance},
                    f"moe Mixtral-shape {name}: {generated} tokens in {seconds:.2f} s = {generated / seconds:.1f} "
                    f"tok/s; expert load max/mean {load.total_imbalance:.2f}")
            del engine
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()  # the next engine sizes its KV cache from free memory
        first = next(iter(results))
        for name, tokens in results.items():
            base = "fp8 torch" if name.startswith("fp8") else first  # fp8 against fp8
            if name != base:
                same = sum(tokens[k] == results[base][k] for k in tokens)
                rep.add(f"moe_parity_{name.replace(' ', '_')}", same,
                        f"moe greedy {name} vs {base}: {same}/{len(tokens)} identical")
