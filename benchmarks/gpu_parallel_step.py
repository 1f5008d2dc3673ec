"""The decode step through a parallel worker process, at the 1B shapes (a section of gpu_engine.py).

One worker process (--distributed-executor-backend mp: NCCL, the driver keeps the scheduler) runs
the decode steps of 128 sequences of ~512 tokens. Alternating, every row's logits go to the driver
to be sampled there (128 x 128256 fp32: 65.7 MB through a pipe per step), or the worker samples the
rows itself and sends the token ids (parallel/remote_sampling.py). Each mode's step wall time is
the median of its rounds, against the same steps in one process measured just before.
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

from common import prefill_all


def section_parallel_step(rep, model_dir: Path, vocab: int, device: str, smoke: bool) -> None:
    import torch
    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.engine.llm_engine import LLMEngine

    nseq, ctx, steps, rounds = (4, 40, 3, 1) if smoke else (128, 512, 10, 2)
    # The worker path runs no graphs: compare like with like. A fixed KV size (128 x ~600 tokens of 32 KiB
    # fit in 4 GiB): no memory plan, which would count this process's memory as the worker's neighbour's.
    kw = {"max_num_seqs": nseq, "enforce_eager": True, "kv_cache_memory": (64 if smoke else 4096) * 2**20}
    times: dict[str, list[float]] = {"one process": [], "logits to the driver": [], "sampling on the worker": []}
    for name, extra in (("one process", {}), ("worker", {"distributed_executor_backend": "mp"})):
        engine = LLMEngine(EngineArgs(model=str(model_dir), device=device, **kw, **extra))
        try:
            modes = ["one process"] if name == "one process" else ["logits to the driver", "sampling on the worker"]
            prefill_all(engine, nseq, ctx, (steps + 2) * rounds * len(modes) + 4, vocab, seed=1)
            for _ in range(rounds):
                for mode in modes:
                    engine.runner.sample_on_worker = mode == "sampling on the worker"
                    engine.step()  # the mode's first step: outside the timing
                    start = time.perf_counter()
                    for _ in range(steps):
                        engine.step()
                    times[mode].append((time.perf_counter() - start) * 1e3 / steps)
        finally:
            engine.close()
            del engine
            gc.collect()  # the in-process engine's weights and cache, before the worker loads its own
            if device == "cuda":
                torch.cuda.empty_cache()
    ms = {mode: statistics.median(t) for mode, t in times.items()}
    base = ms["one process"]
    for mode, value in ms.items():
        key = mode.replace(" ", "_")
        rep.add(f"parallel_step_{key}", {"step_ms": value, "x_one_process": value / base},
                f"parallel step {device} {nseq} seqs x ~{ctx} tokens, {mode}: {value:.2f} ms ({value / base:.2f}x one "
                f"process, eager)")
