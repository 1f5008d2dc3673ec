"""Tensor and pipeline parallelism on CPU: decode step time, communication per step and tokens/s
at TP 1 and 2, PP 1 and 2, against one process measured in the same run.

    .venv/bin/python benchmarks/parallel.py [--batch 32] [--prompt 64] [--tokens 64] [--configs 1x1,2x1,1x2]
                                            [--repeats 3] [--threads 1]

The ~30M-parameter dummy Llama (benchmarks/common.py), fp32, --batch requests of --prompt random
token ids, each generating --tokens tokens (EOS ignored). Step time is the median wall time of
the driver's decode-only steps (the batch full); communication is what TP rank 0 of the last
stage measured per step (all-reduce of the row-parallel outputs and the embedding, all-gather of
the vocabulary-parallel logits, send/recv of hidden states between stages, the latter including
the wait for the previous stage). Tokens/s is over the whole run, prefill included.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import LLAMA_30M, make_model_dir, workload


def run(model_dir: str, tp: int, pp: int, batch: int, prompt: int, tokens: int, threads: int) -> dict:
    import torch
    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.engine.llm_engine import LLMEngine
    from kvrelay.engine.sampling_params import SamplingParams

    torch.set_num_threads(threads)  # one process: its intra-op threads; several: each worker gets cores / N
    engine = LLMEngine(EngineArgs(model=model_dir, load_format="dummy", kv_cache_memory=256 * 2**20,
                                  tensor_parallel_size=tp, pipeline_parallel_size=pp, max_num_seqs=batch))
    try:
        reqs = workload(batch, (prompt, prompt), (tokens, tokens), LLAMA_30M["vocab_size"])
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        for i, (ids, _) in enumerate(reqs):
            engine.add_request(ids, params, str(i))
        decode_steps, generated = [], 0
        comm_before = None
        started = time.perf_counter()
        while engine.has_work():
            full_decode = len(engine.scheduler.running) == batch and not engine.scheduler.waiting
            if full_decode and comm_before is None and engine.executor is not None:
                s = engine.executor.stats
                comm_before = (s.steps, dict(s.comm_s), dict(s.comm_bytes))
            t = time.perf_counter()
            outs = engine.step()
            if full_decode and all(len(o.new_token_ids) == 1 for o in outs) and len(outs) == batch:
                decode_steps.append(time.perf_counter() - t)
            generated += sum(len(o.new_token_ids) for o in outs)
        elapsed = time.perf_counter() - started
        comm = {}
        if engine.executor is not None and comm_before is not None:
            s = engine.executor.stats
            n = max(1, s.steps - comm_before[0])
            for kind in s.comm_s:
                comm[kind] = ((s.comm_s[kind] - comm_before[1].get(kind, 0.0)) / n * 1e3,
                              (s.comm_bytes[kind] - comm_before[2].get(kind, 0)) / n / 2**10)
        return {"step_ms": statistics.median(decode_steps) * 1e3, "tok_s": generated / elapsed, "comm": comm,
                "steps": len(decode_steps)}
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--configs", default="1x1,2x1,1x2", help="TPxPP pairs, the first one the baseline")
    ap.add_argument("--repeats", type=int, default=3, help="runs per config (the median run is shown)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the single process (workers get cores / world size each)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_model_dir(Path(tmp) / "llama30m", LLAMA_30M, with_weights=False))
        pairs = [tuple(int(x) for x in pair.split("x")) for pair in args.configs.split(",")]
        runs: dict[tuple[int, int], list[dict]] = {p: [] for p in pairs}
        for _ in range(args.repeats):  # interleaved: load from other processes hits every config alike
            for tp, pp in pairs:
                runs[(tp, pp)].append(run(model, tp, pp, args.batch, args.prompt, args.tokens, args.threads))
        results = []
        for tp, pp in pairs:  # the run of median step time, per config
            rs = sorted(runs[(tp, pp)], key=lambda r: r["step_ms"])
            results.append((tp, pp, rs[len(rs) // 2]))
        base = results[0][2]
        print(f"batch {args.batch}, prompt {args.prompt}, {args.tokens} tokens each; ~30M dummy Llama fp32, CPU; "
              f"median of {args.repeats} runs")
        print(f"{'TP':>3} {'PP':>3} {'step ms':>8} {'x base':>7} {'tok/s':>8} {'x base':>7}  communication per step")
        for tp, pp, r in results:
            comm = ", ".join(f"{k} {ms:.2f} ms / {kib:.0f} KiB" for k, (ms, kib) in sorted(r["comm"].items()))
            print(f"{tp:>3} {pp:>3} {r['step_ms']:>8.2f} {r['step_ms'] / base['step_ms']:>7.2f} {r['tok_s']:>8.1f} "
                  f"{r['tok_s'] / base['tok_s']:>7.2f}  {comm or '-'}")


if __name__ == "__main__":
    main()
