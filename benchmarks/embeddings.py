"""Embedding throughput: kvrelay's pooling engine (continuous batching, chunked prefill, paged K/V)
against transformers' AutoModel on the same weights and prompts, padded batches and one prompt at a time.

    .venv/bin/python benchmarks/embeddings.py [--requests 64] [--batch 16] [--rounds 2]

A ~30M-parameter Llama (random weights, fp32), last-token pooling, normalized. Prompts are random
token ids of 16-256 tokens. Each system runs in turn, rounds times; the figures are medians, the
ratios against HF's padded batches in the same run. The vectors are checked against HF's first.
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


def run_kvrelay(engine, prompts: list[list[int]]):
    from kvrelay.engine.pooling.params import PoolingParams
    from kvrelay.engine.sampling_params import SamplingParams

    vectors = {}
    start = time.perf_counter()
    for k, ids in enumerate(prompts):
        engine.add_request(ids, SamplingParams(pooling=PoolingParams()), f"e{k}")
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                vectors[out.request_id] = out.embedding
    return time.perf_counter() - start, [vectors[f"e{k}"] for k in range(len(prompts))]


def run_hf(model, prompts: list[list[int]], batch: int):
    """Right-padded batches with an attention mask; each row's last real token, normalized."""
    import torch
    import torch.nn.functional as F

    out = []
    start = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(prompts), batch):
            chunk = prompts[b : b + batch]
            width = max(map(len, chunk))
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros(len(chunk), width, dtype=torch.long)
            for r, p in enumerate(chunk):
                ids[r, : len(p)] = torch.tensor(p)
                mask[r, : len(p)] = 1
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = hidden[torch.arange(len(chunk)), mask.sum(1) - 1]
            out += F.normalize(last.float(), dim=-1).tolist()
    return time.perf_counter() - start, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16, help="HF's padded batch size")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()

    import torch
    import transformers
    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.engine.llm_engine import LLMEngine

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(Path(tmp) / "llama30m", LLAMA_30M, with_weights=True)
        prompts = [ids for ids, _ in workload(args.requests, (16, 256), (1, 1), LLAMA_30M["vocab_size"], seed=7)]
        tokens = sum(map(len, prompts))
        engine = LLMEngine(EngineArgs(model=str(model_dir), runner="pooling", max_num_seqs=args.requests))
        hf = transformers.AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        _, ours = run_kvrelay(engine, prompts[:4])  # warm-up, and the check
        _, ref = run_hf(hf, prompts[:4], 4)
        diff = max(abs(a - b) for u, v in zip(ours, ref) for a, b in zip(u, v))
        print(f"vectors: max |kvrelay - HF| = {diff:.2e} over 4 prompts")
        if diff > 1e-4:
            raise SystemExit("MISMATCH: kvrelay's vectors differ from transformers'")
        times: dict[str, list[float]] = {"kvrelay": [], f"HF padded batches of {args.batch}": [], "HF one at a time": []}
        for _ in range(args.rounds):
            times["kvrelay"].append(run_kvrelay(engine, prompts)[0])
            times[f"HF padded batches of {args.batch}"].append(run_hf(hf, prompts, args.batch)[0])
            times["HF one at a time"].append(run_hf(hf, prompts, 1)[0])
    base = statistics.median(times[f"HF padded batches of {args.batch}"])
    print(f"{args.requests} prompts, {tokens} tokens, median of {args.rounds} rounds, torch threads "
          f"{torch.get_num_threads()}")
    print("| system | embeddings/s | prompt tok/s | vs HF padded |\n|---|---:|---:|---:|")
    rows = {}
    for name, ts in times.items():
        t = statistics.median(ts)
        rows[name] = {"seconds": t, "embeddings_per_s": args.requests / t, "tokens_per_s": tokens / t}
        print(f"| {name} | {args.requests / t:.1f} | {tokens / t:,.0f} | {base / t:.2f}x |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
