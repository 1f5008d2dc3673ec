"""Throughput: kvrelay vs HF generate one request at a time vs HF generate in padded static batches.

    .venv/bin/python benchmarks/throughput.py [--requests 64] [--hf-seq-requests 8] [--hf-batch 16] [--rounds 1]

A ~30M-parameter Llama with random weights, fp32, 64 requests with prompts of 32-512 tokens and
outputs of 32-256 tokens. Each system runs in its own subprocess (so peak RSS is its own) and
reports generated tokens per second; the sequential baseline runs a subset of the requests,
since its rate does not depend on how many there are. EOS is ignored so every request
generates exactly its output length in every system.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import LLAMA_30M, make_model_dir, peak_rss_mib, workload


def run_kvrelay(model_dir: str, reqs) -> dict:
    """`kvrelay bench throughput`'s measurement, without its warm-up (the HF baselines get none)."""
    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.engine.llm_engine import LLMEngine

    from kvrelay.bench.throughput import measure

    engine = LLMEngine(EngineArgs(model=model_dir, kv_cache_memory=2 * 2**30, max_num_batched_tokens=2048))
    r = measure(engine, [ids for ids, _ in reqs], [n for _, n in reqs], warmup=False)
    return {"tokens": r["output_tokens"], "seconds": r["elapsed_s"]}


def _hf_model(model_dir: str):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), torch


def run_hf_sequential(model_dir: str, reqs) -> dict:
    model, torch = _hf_model(model_dir)
    start, generated = time.perf_counter(), 0
    with torch.no_grad():
        for ids, n in reqs:
            out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
            generated += out.shape[1] - len(ids)
    return {"tokens": generated, "seconds": time.perf_counter() - start}


def run_hf_batched(model_dir: str, reqs, batch: int) -> dict:
    """Static batches in arrival order, left-padded; a batch runs until its longest output is done."""
    model, torch = _hf_model(model_dir)
    start, useful = time.perf_counter(), 0
    with torch.no_grad():
        for b in range(0, len(reqs), batch):
            group = reqs[b : b + batch]
            width = max(len(ids) for ids, _ in group)
            input_ids = torch.tensor([[0] * (width - len(ids)) + ids for ids, _ in group])
            mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in group])
            longest = max(n for _, n in group)
            model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=0,
            )
            useful += sum(n for _, n in group)  # what the requests asked for; the rest is waste
    return {"tokens": useful, "seconds": time.perf_counter() - start}


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    reqs = workload(args.requests, (32, 512), (32, 256), LLAMA_30M["vocab_size"])
    if args.mode == "kvrelay":
        result = run_kvrelay(args.model_dir, reqs)
    elif args.mode == "hf-seq":
        result = run_hf_sequential(args.model_dir, reqs[: args.hf_seq_requests])
    else:
        result = run_hf_batched(args.model_dir, reqs, args.hf_batch)
    result["peak_rss_mib"] = peak_rss_mib()
    print(json.dumps(result))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--hf-seq-requests", type=int, default=8)
    p.add_argument("--hf-batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1, help="kvrelay + HF sequential pairs; the median ratio is printed")
    p.add_argument("--mode", choices=["kvrelay", "hf-seq", "hf-batch"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.mode:
        return child(args)

    model_dir = Path(tempfile.gettempdir()) / "kvrelay-bench-llama30m"
    make_model_dir(model_dir, LLAMA_30M, with_weights=True)

    def run(mode: str) -> float:
        cmd = [sys.executable, __file__, "--mode", mode, "--model-dir", str(model_dir)]
        cmd += ["--requests", str(args.requests), "--hf-seq-requests", str(args.hf_seq_requests)]
        cmd += ["--hf-batch", str(args.hf_batch), "--threads", str(args.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{mode:9s} {r['tokens']:6d} tokens in {r['seconds']:7.1f} s = {r['tokens'] / r['seconds']:8.1f} tok/s"
            f"   peak RSS {r['peak_rss_mib']:.0f} MiB",
            flush=True,
        )
        return r["tokens"] / r["seconds"]

    # kvrelay and the sequential baseline run back to back in each round, so a drift in the
    # machine's speed moves both sides of a round's ratio; the median ratio is the figure.
    seq_ratios = []
    for _ in range(args.rounds):
        kv = run("kvrelay")
        seq_ratios.append(kv / run("hf-seq"))
    batch_ratio = kv / run("hf-batch")
    if args.rounds > 1:
        print("kvrelay / HF sequential per round: " + ", ".join(f"{r:.2f}x" for r in seq_ratios))
    print(f"kvrelay / HF sequential    = {statistics.median(seq_ratios):.1f}x  (target >= 8x)")
    print(f"kvrelay / HF padded batch  = {batch_ratio:.1f}x  (target >= 2x)")


if __name__ == "__main__":
    main()
