"""Tensor and pipeline parallelism on CPU: decode step time, communication per step and tokens/s
at TP 1 and 2, PP 1 and 2 (with overlapping stages, and without: suffix "s"), against one process
measured in the same run. Suffix letters: "s" PP without overlapping stages; "d" the driver makes each
step's text and outputs while the workers compute the next step (async_output, the default with CUDA
workers); "a" --async-scheduling; "m" worker processes at world size 1 (--distributed-executor-backend mp);
"l" every row's logits sent to the driver to be sampled there (as before the workers sampled plain rows).

    .venv/bin/python benchmarks/parallel.py [--batch 32] [--prompt 64] [--tokens 64]
                                            [--configs 1x1,2x1,1x2s,1x2] [--repeats 3] [--threads 1]
    .venv/bin/python benchmarks/parallel.py --configs 1x1,1x1m,1x1md,1x1ma,2x1,2x1d,2x1a   # the driver's overlap
    .venv/bin/python benchmarks/parallel.py --configs 1x1,1x1ml,1x1m,2x1l,2x1 --layers 1    # sampling on the worker
    .venv/bin/python benchmarks/parallel.py --configs 1x1,1x1ml,1x1m,2x1l,2x1 --layers 1 --repetition-penalty 1.1

The ~30M-parameter dummy Llama (benchmarks/common.py; --vocab and --layers change it), fp32, --batch
requests of --prompt random token ids, each generating --tokens tokens (EOS ignored; greedy, with
--repetition-penalty on every request, which the worker applies from each row's history). Step time is the
driver's wall time per decode token of every sequence while the batch is full (decode-only): with
overlapping stages one engine step samples one group (half the batch at PP=2), so it is the phase's
time x batch / tokens; "in flight" is the most steps the executor held submitted and uncollected at
once. Communication is what TP rank 0 of the last stage measured per engine step (all-reduce of the
row-parallel outputs and the embedding, all-gather of the vocabulary-parallel logits, send/recv of
hidden states between stages, the latter including the wait for the previous stage). Tokens/s is
over the whole run, prefill included. The LM head runs on the last stage: with the default vocabulary
of 32000 (16M weights) it outweighs four layers (13M), so PP=2 is unbalanced; --vocab 2048 balances it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import LLAMA_30M, make_model_dir, workload


def run(model_dir: str, tp: int, pp: int, mode: str, batch: int, prompt: int, tokens: int, threads: int,
        vocab: int, repetition_penalty: float = 1.0) -> dict:
    """mode: the config's suffix letters (see the module's doc)."""
    import torch
    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.engine.llm_engine import LLMEngine
    from kvrelay.engine.sampling_params import SamplingParams

    torch.set_num_threads(threads)  # one process: its intra-op threads; several: each worker gets cores / N
    engine = LLMEngine(EngineArgs(model=model_dir, load_format="dummy", kv_cache_memory=256 * 2**20,
                                  tensor_parallel_size=tp, pipeline_parallel_size=pp, max_num_seqs=batch,
                                  pipeline_overlap="s" not in mode, async_output="d" in mode or "a" in mode,
                                  async_scheduling="a" in mode,
                                  distributed_executor_backend="mp" if "m" in mode else None))
    try:
        if "l" in mode:
            engine.runner.sample_on_worker = False
        reqs = workload(batch, (prompt, prompt), (tokens, tokens), vocab)
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                                repetition_penalty=repetition_penalty)
        for i, (ids, _) in enumerate(reqs):
            engine.add_request(ids, params, str(i))
        decode_s, decode_tokens, generated = 0.0, 0, 0
        comm_before = None
        started = time.perf_counter()
        while engine.has_work():
            full_decode = len(engine.scheduler.running) == batch and not engine.scheduler.waiting
            if full_decode and comm_before is None and engine.executor is not None:
                s = engine.executor.stats
                comm_before = (s.steps, dict(s.comm_s), dict(s.comm_bytes))
            t = time.perf_counter()
            outs = engine.step()
            new = sum(len(o.new_token_ids) for o in outs)
            if full_decode and all(len(o.new_token_ids) == 1 for o in outs):
                decode_s += time.perf_counter() - t
                decode_tokens += new
            generated += new
        elapsed = time.perf_counter() - started
        comm = {}
        if engine.executor is not None and comm_before is not None:
            s = engine.executor.stats
            n = max(1, s.steps - comm_before[0])
            for kind in s.comm_s:
                comm[kind] = ((s.comm_s[kind] - comm_before[1].get(kind, 0.0)) / n * 1e3,
                              (s.comm_bytes[kind] - comm_before[2].get(kind, 0)) / n / 2**10)
        in_flight = engine.executor.max_in_flight if engine.executor is not None else 0
        return {"step_ms": decode_s / max(1, decode_tokens) * batch * 1e3, "tok_s": generated / elapsed,
                "comm": comm, "in_flight": in_flight}
    finally:
        engine.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--configs", default="1x1,2x1,1x2s,1x2",
                    help="TPxPP pairs, the first one the baseline; suffix s: PP without overlapping stages, "
                         "d: outputs during the next forward, a: --async-scheduling, m: mp backend at world size 1, "
                         "l: logits to the driver")
    ap.add_argument("--vocab", type=int, default=LLAMA_30M["vocab_size"],
                    help="vocabulary size (the LM head runs on the last stage: a smaller one balances PP's stages)")
    ap.add_argument("--layers", type=int, default=LLAMA_30M["num_hidden_layers"])
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3, help="runs per config (the median run is shown)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the single process (workers get cores / world size each)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = LLAMA_30M | {"vocab_size": args.vocab, "num_hidden_layers": args.layers}
        model = str(make_model_dir(Path(tmp) / "llama", config, with_weights=False))
        pairs = []
        for pair in args.configs.split(","):
            mode = pair.lstrip("0123456789x")
            tp, pp = pair.removesuffix(mode).split("x")
            pairs.append((int(tp), int(pp), mode))
        runs: dict[tuple[int, int, str], list[dict]] = {p: [] for p in pairs}
        for _ in range(args.repeats):  # interleaved: load from other processes hits every config alike
            for tp, pp, mode in pairs:
                runs[(tp, pp, mode)].append(run(model, tp, pp, mode, args.batch, args.prompt, args.tokens,
                                                args.threads, args.vocab, args.repetition_penalty))
        results = []
        for key in pairs:  # the run of median step time, per config
            rs = sorted(runs[key], key=lambda r: r["step_ms"])
            results.append((*key, rs[len(rs) // 2]))
        base = results[0][3]
        print(f"batch {args.batch}, prompt {args.prompt}, {args.tokens} tokens each, repetition penalty "
              f"{args.repetition_penalty}; dummy Llama ({args.layers} layers, vocab {args.vocab}) fp32, CPU; "
              f"median of {args.repeats} runs")
        print(f"{'config':>7} {'TP':>3} {'PP':>3} {'overlap':>7} {'outputs':>8} {'in flight':>9} {'step ms':>8} {'x base':>7} "
              f"{'tok/s':>8} {'x base':>7}  communication per step")
        for tp, pp, mode, r in results:
            comm = ", ".join(f"{k} {ms:.2f} ms / {kib:.0f} KiB" for k, (ms, kib) in sorted(r["comm"].items()))
            flag = "no" if "s" in mode else "yes" if pp > 1 else "-"
            workers = tp * pp > 1 or "m" in mode
            made = "async" if "a" in mode else "during" if "d" in mode else "after" if workers else "-"
            print(f"{f'{tp}x{pp}{mode}':>7} {tp:>3} {pp:>3} {flag:>7} {made:>8} {r['in_flight']:>9} {r['step_ms']:>8.2f} "
                  f"{r['step_ms'] / base['step_ms']:>7.2f} {r['tok_s']:>8.1f} {r['tok_s'] / base['tok_s']:>7.2f}  "
                  f"{comm or '-'}")
        by_key = {(tp, pp, mode): r for tp, pp, mode, r in results}
        for (tp, pp, mode), r in by_key.items():
            plain = mode.replace("d", "").replace("a", "")
            if "s" not in mode and pp > 1 and (tp, pp, mode + "s") in by_key:
                other, what = by_key[(tp, pp, mode + "s")], "overlapping stages vs not"
            elif "l" not in mode and (tp, pp, mode + "l") in by_key:
                other, what = by_key[(tp, pp, mode + "l")], "sampling on the worker vs logits to the driver"
            elif plain != mode and (tp, pp, plain) in by_key:
                other, what = by_key[(tp, pp, plain)], f"outputs {'async' if 'a' in mode else 'during'} vs after"
            else:
                continue
            print(f"{tp}x{pp}{mode} {what}: step x{r['step_ms'] / other['step_ms']:.2f}, "
                  f"tok/s x{r['tok_s'] / other['tok_s']:.2f}")

if __name__ == "__main__":
    main()
