"""Sliding-window attention on CPU: KV blocks held and decode speed, window on every layer vs none.

    .venv/bin/python benchmarks/sliding_window.py [--context 4096] [--window 256] [--seqs 8]

A ~30M-parameter Mistral-shaped model (benchmarks/common.LLAMA_30M with a sliding window, dummy
weights) generates for --seqs sequences from short prompts up to --context tokens each. Prints,
for the windowed model and the same model without a window: the most KV blocks held at once, and
the milliseconds per decode step over the last 256 steps (where full attention reads the longest
contexts and the window reads --window tokens).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import LLAMA_30M, make_model_dir
from kvrelay.engine.engine_args import EngineArgs
from kvrelay.engine.llm_engine import LLMEngine
from kvrelay.engine.sampling_params import SamplingParams


def run(model_dir: Path, context: int, seqs: int) -> tuple[int, float]:
    engine = LLMEngine(EngineArgs(model=str(model_dir), load_format="dummy", max_model_len=context,
                                  num_kv_blocks=seqs * (context // 16 + 1)))
    params = SamplingParams(max_tokens=context - 8, min_tokens=context - 8, temperature=0.0, ignore_eos=True)
    for i in range(seqs):
        engine.add_request([3 + i] * 8, params, str(i))
    peak, step_times = 0, []
    while engine.has_work():
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
        peak = max(peak, engine.pool.num_blocks - engine.pool.num_free)
    tail = sorted(step_times[-256:])
    return peak, tail[len(tail) // 2] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--seqs", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name, window in (("window", args.window), ("full", None)):
            config = LLAMA_30M | {"architectures": ["MistralForCausalLM"], "max_position_embeddings": args.context,
                                  "sliding_window": window}
            model_dir = make_model_dir(Path(tmp) / name, config, with_weights=False)
            peak, ms = run(model_dir, args.context, args.seqs)
            print(f"{name:6s} window={window}: peak KV blocks held {peak}, median decode step (last 256) {ms:.1f} ms")


if __name__ == "__main__":
    main()
