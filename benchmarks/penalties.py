"""Repetition, frequency and presence penalties of a decode step's rows: the batched
`sampler.penalize` against the per-row code it replaced (2026-12-07), measured in the same run.

    .venv/bin/python benchmarks/penalties.py [--rows 64,128] [--vocab 32000,128256] [--history 512]
                                             [--device cpu] [--repeats 30]

The baseline is that code as it was: one row at a time, each penalty a pass over the whole
vocabulary (a zeroed mask or count row, a scatter, where/sub over every logit). The batched one
gathers only the penalised tokens and writes them back by flat index. Each row has --history token
ids (a quarter of them output). Printed per shape: milliseconds per step (median of --repeats) and
torch ops per step (what each launches on a GPU: a count, so it holds on a noisy machine).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from package_map import map_kvrelay  # kvrelay on a bare GPU machine too


def per_row(logits, rows, penalties) -> None:
    """The replaced code (sampler._adjust's penalties before batching), row by row."""
    import torch

    vocab = logits.shape[1]
    for i, q in zip(rows, penalties):
        row = logits[i]
        if q.repetition != 1.0:
            seen = torch.zeros(vocab, dtype=torch.bool, device=row.device)
            history = q.prompt.tolist() + list(q.output)
            seen[torch.tensor([t for t in history if 0 <= t < vocab], device=row.device)] = True
            penalised = torch.where(row > 0, row / q.repetition, row * q.repetition)
            row.copy_(torch.where(seen, penalised, row))
        if q.presence or q.frequency:
            counts = torch.zeros(vocab, dtype=torch.float32, device=row.device)
            out = [t for t in q.output if 0 <= t < vocab]
            counts.index_add_(0, torch.tensor(out, device=row.device), torch.ones(len(out), device=row.device))
            row -= q.frequency * counts + q.presence * (counts > 0).float()


def time_it(fn, logits, rows, penalties, repeats: int, sync) -> tuple[float, int]:
    import torch

    work = logits.clone()
    fn(work, rows, penalties)  # warm-up
    times = []
    for _ in range(repeats):
        work.copy_(logits)
        sync()
        t = time.perf_counter()
        fn(work, rows, penalties)
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn(work, rows, penalties)
    ops = sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)
    return statistics.median(times), ops


KINDS = {"repetition 1.1": (1.1, 0.0, 0.0), "frequency 0.5 + presence 0.3": (1.0, 0.5, 0.3),
         "all three": (1.1, 0.5, 0.3)}


def measure(device: str, nrows: int, vocab: int, history: int, repeats: int) -> list[dict]:
    """Per kind of penalty: both codes' ms and ops per step on [nrows, vocab] logits, after checking
    that they give the same logits."""
    import numpy as np
    import torch
    from kvrelay.engine.sampler import Penalties, penalize

    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(nrows, vocab, generator=gen) * 3).to(dev)
    histories = [torch.randint(0, vocab, (history,), generator=gen).tolist() for _ in range(nrows)]
    rows = list(range(nrows))
    results = []
    for name, (r, f, p) in KINDS.items():
        cut = history * 3 // 4
        qs = [Penalties(r, f, p, np.unique(np.array(h[:cut], dtype=np.int32)), h[cut:]) for h in histories]  # as the engine
        base_ms, base_ops = time_it(per_row, logits, rows, qs, repeats, sync)
        new_ms, new_ops = time_it(penalize, logits, rows, qs, repeats, sync)
        a, b = logits.clone(), logits.clone()
        per_row(a, rows, qs)
        penalize(b, rows, qs)
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)  # the same penalties
        results.append({"kind": name, "rows": nrows, "vocab": vocab, "per_row_ms": base_ms, "batched_ms": new_ms,
                        "per_row_ops": base_ops, "batched_ops": new_ops})
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="64,128")
    ap.add_argument("--vocab", default="32000,128256")
    ap.add_argument("--history", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    map_kvrelay()
    import torch

    torch.set_num_threads(args.threads)
    print(f"{args.device}, {args.threads} thread(s), {args.history} tokens of history a row (a quarter output); "
          f"median of {args.repeats}")
    print(f"{'penalties':>28} {'rows':>5} {'vocab':>7} {'per row ms':>11} {'batched ms':>11} {'x':>6} "
          f"{'ops per row-by-row':>19} {'ops batched':>12}")
    for vocab in [int(v) for v in args.vocab.split(",")]:
        for nrows in [int(r) for r in args.rows.split(",")]:
            for m in measure(args.device, nrows, vocab, args.history, args.repeats):
                print(f"{m['kind']:>28} {nrows:>5} {vocab:>7} {m['per_row_ms']:>11.2f} {m['batched_ms']:>11.2f} "
                      f"{m['batched_ms'] / m['per_row_ms']:>6.3f} {m['per_row_ops']:>19} {m['batched_ops']:>12}")


if __name__ == "__main__":
    main()
