"""Engine overhead: milliseconds per decode step with 64 running sequences on stories260K.

    .venv/bin/python benchmarks/engine_overhead.py [--seqs 64] [--steps 200] [--host] [--profile]

stories260K's compute is tiny, so a step's time is mostly the engine itself: scheduling,
batch building, sampling, detokenizing. The model forward is timed separately in the same
run, and the rest is reported as overhead (target: <= 2 ms per step).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import peak_rss_mib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--async-scheduling", action="store_true",
                   help="the engine's --async-scheduling (on CPU nothing overlaps: this measures its bookkeeping)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="then profile as many steps with the forward replaced by fixed logits (the host work a GPU step "
        "pays while the device computes) and print where the time goes (cProfile, by own time)",
    )
    p.add_argument(
        "--host",
        action="store_true",
        help="then time as many steps with the forward replaced by fixed logits (text-like: no byte-fallback "
        "tokens): min and median ms over chunks of 40 steps, and Python function calls per step (a count, "
        "so it holds on a noisy machine)",
    )
    args = p.parse_args()

    import torch
    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.engine.llm_engine import LLMEngine
    from kvrelay.engine.sampling_params import SamplingParams

    if (1 + args.profile + args.host) * args.steps + 40 > 500:
        p.error("stories260K holds 512 tokens: (1 + --profile + --host) x --steps must stay under 460")
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineArgs(async_scheduling=args.async_scheduling))
    forward = engine.model.forward
    forward_time = [0.0]

    def timed_forward(batch, kv_cache):
        start = time.perf_counter()
        out = forward(batch, kv_cache)
        forward_time[0] += time.perf_counter() - start
        return out

    engine.model.forward = timed_forward
    for i in range(args.seqs):
        # Enough tokens for the warm-up, the timed steps and the profiled ones.
        budget = (1 + args.profile + args.host) * args.steps + 40
        params = SamplingParams(max_tokens=budget, temperature=0.8, seed=i, ignore_eos=True)
        engine.add_request("Once upon a time", params, str(i))
    engine.step()  # prefill all prompts
    for _ in range(5):  # warm up decode
        engine.step()
    forward_time[0] = 0.0
    start = time.perf_counter()
    for _ in range(args.steps):
        assert len(engine.step()) == args.seqs
    total = (time.perf_counter() - start) / args.steps * 1000
    model = forward_time[0] / args.steps * 1000
    print(f"decode step with {args.seqs} running sequences: {total:.2f} ms total")
    print(f"  model forward: {model:.2f} ms")
    print(
        f"  engine overhead (scheduling, batch building, sampling, detokenizing): {total - model:.2f} ms "
        f"(target <= 2 ms)"
    )
    print(f"  peak RSS {peak_rss_mib():.0f} MiB")
    if args.host or args.profile:
        fixed_logits(engine)
    if args.host:
        time_host_work(engine, args.steps)
    if args.profile:
        profile_host_work(engine, args.steps)


def fixed_logits(engine) -> None:
    """The forward replaced by fixed logits: what is left is the host work a GPU step pays while the
    device computes. Byte-fallback tokens (ids 3..258 in stories260K's vocabulary) get no mass, so
    the detokenizer sees text-like tokens, as real output mostly is."""
    import torch

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(engine.args.max_num_seqs, engine.config.vocab_size, generator=gen)
    logits[:, :259] = -30.0
    engine.model.forward = lambda batch, kv_cache: logits[: batch.logits_indices.shape[0]]


def time_host_work(engine, steps: int) -> None:
    import cProfile
    import pstats

    chunks = []
    for _ in range(max(1, steps // 40)):
        start = time.perf_counter()
        for _ in range(40):
            engine.step()
        chunks.append((time.perf_counter() - start) / 40 * 1e3)
    chunks.sort()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        engine.step()
    profiler.disable()
    calls = pstats.Stats(profiler).total_calls / 20
    print(f"host work per step without the forward: min {chunks[0]:.2f} ms, median {chunks[len(chunks) // 2]:.2f} ms "
          f"over {len(chunks)} chunks of 40 steps; {calls:,.0f} Python function calls per step")


def profile_host_work(engine, steps: int) -> None:
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        assert len(engine.step()) == len(engine.scheduler.running)
    profiler.disable()
    stats = pstats.Stats(profiler)
    print(f"host work per step without the forward, {steps} steps under cProfile:")
    stats.sort_stats("tottime").print_stats(12)
    total = stats.total_tt
    for name in ("_settle_token", "build", "schedule", "sample_on_device"):
        cum = sum(v[3] for k, v in stats.stats.items() if k[2] == name)
        print(f"  {name}: {100 * cum / total:.0f}% of the step (with what it calls)")


if __name__ == "__main__":
    main()
