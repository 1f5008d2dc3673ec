"""LoRA serving cost: generated tokens per second of the base model alone, of every request on one
adapter, and of requests spread over several adapters and the base model in the same batches.

    .venv/bin/python benchmarks/lora.py [--requests 32] [--adapters 4] [--rank 16] [--rounds 2]
    .venv/bin/python benchmarks/lora.py --delta   # the delta of one projection alone, per layout

A ~30M-parameter Llama (random weights, fp32) and random rank-r adapters on every projection
(q, k, v, o, gate, up, down), written as PEFT saves them. Each case runs in the same process, in
turn, rounds times; the figures are medians and ratios against the base model in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import LLAMA_30M, make_model_dir, workload

MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(out: Path, config: dict, rank: int, seed: int, std: float = 0.02) -> Path:
    """A random PEFT LoRA folder (adapter_config.json, adapter_model.safetensors) for config; A and B
    normal with standard deviation std."""
    import torch
    from safetensors.torch import save_file

    h, i = config["hidden_size"], config["intermediate_size"]
    q = config["num_attention_heads"] * config["head_dim"]
    kv = config["num_key_value_heads"] * config["head_dim"]
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (out_dim, in_dim) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{MODULES[module]}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_dim, generator=gen) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_dim, rank, generator=gen) * std
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(shapes), "bias": "none"}))
    return out


def run(engine, reqs, loras: list[str | None]) -> float:
    """Every request at once, request k on loras[k % len(loras)]; generated tokens per second."""
    import time

    from kvrelay.engine.sampling_params import SamplingParams

    for k, (ids, n) in enumerate(reqs):
        engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                               lora=loras[k % len(loras)]), f"r{k}")
    start, tokens = time.perf_counter(), 0
    while engine.has_work():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - start)


def _median_s(fn, *args, rounds: int = 200) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _per_part_delta(x, a, parts, out):
    """The alternative layout: each part's B multiplies only its rows (lo, hi, B [rows, R], rank columns)."""
    xa = x @ a.T
    for lo, hi, b, cols in parts:
        out[:, lo:hi] += xa[:, cols] @ b.T
    return out


def time_delta(engine) -> None:
    """One adapter's delta on layer 0's qkv and gate_up, for 32 and 256 rows: the engine's stack
    (stacked.py: one block-diagonal B over every part) against each part's B multiplying only its
    rows, built from the same weights here; and the base projection's matmul for scale. Medians of
    200 calls. (docs/benchmarks.md: per-part is faster only for qkv at 256 rows.)"""
    import torch
    import torch.nn.functional as F

    layer = engine.model.w.layers[0]
    print(f"{'projection':<10} {'rows':>5} {'base matmul':>12} {'block-diag B':>13} {'per-part B':>11} {'part/diag':>9}")
    for name, bounds in (("qkv", ("q_size", "kv_size", "kv_size")), ("gate_up", ("intermediate_size",) * 2)):
        lin = getattr(layer, name)
        stack, config = lin.lora, engine.config
        rank = stack.a.shape[1] // len(bounds)
        parts, lo = [], 0
        for j, field in enumerate(bounds):
            hi = lo + getattr(config, field)
            cols = slice(j * rank, (j + 1) * rank)
            parts.append((lo, hi, stack.b[0, lo:hi, cols].contiguous(), cols))
            lo = hi
        for rows in (32, 256):
            x = torch.randn(rows, stack.a.shape[2])
            out = F.linear(x, lin.weight)
            base = _median_s(F.linear, x, lin.weight)
            diag = _median_s(stack.add, x, out, [(0, None)])
            split = _median_s(_per_part_delta, x, stack.a[0], parts, out)
            print(f"{name:<10} {rows:>5} {base * 1e6:>10.0f}us {diag * 1e6:>11.0f}us {split * 1e6:>9.0f}us "
                  f"{split / diag:>5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--delta", action="store_true", help="time one projection's delta per layout instead")
    args = parser.parse_args()

    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.engine.llm_engine import LLMEngine

    root = Path(tempfile.mkdtemp(prefix="kvrelay-lora-bench-"))
    model_dir = make_model_dir(root / "model", LLAMA_30M, with_weights=False)
    names = [f"a{k}" for k in range(args.adapters)]
    modules = [f"{n}={write_adapter(root / n, LLAMA_30M, args.rank, k)}" for k, n in enumerate(names)]
    engine = LLMEngine(EngineArgs(model=str(model_dir), load_format="dummy", kv_cache_memory=2**30,
                                  enable_prefix_caching=False, lora_modules=modules, max_lora_rank=args.rank))
    if args.delta:
        time_delta(engine)
        return
    reqs = workload(args.requests, (32, 256), (32, 64), LLAMA_30M["vocab_size"], seed=1)
    cases = {"base model": [None], "one adapter": [names[0]],
             f"{args.adapters} adapters + base, mixed": [None, *names]}
    run(engine, reqs[:2], [None, names[0]])  # warm-up
    results: dict[str, list[float]] = {case: [] for case in cases}
    for _ in range(args.rounds):
        for case, loras in cases.items():
            results[case].append(run(engine, reqs, loras))
    base = statistics.median(results["base model"])
    print(f"{args.requests} requests, prompts 32-256, outputs 32-64 tokens, rank {args.rank} on every "
          f"projection, {args.rounds} rounds (median)")
    print(f"{'case':<28} {'tok/s':>8} {'vs base':>8}")
    for case, rates in results.items():
        rate = statistics.median(rates)
        print(f"{case:<28} {rate:>8.1f} {rate / base:>7.2f}x")


if __name__ == "__main__":
    main()
