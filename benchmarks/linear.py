"""CPU linear layers: torch's F.linear (MKL) against the native kernel over packed weights.

    .venv/bin/python benchmarks/linear.py [--rows 1,8,38,64,512,2048] [--threads 2]

The shapes of the ~30M-parameter Llama of benchmarks/throughput.py (hidden 512, MLP 1376, vocab
32000), fp32: per row count, one step's projections over 8 layers (each layer its own weights,
100 MB in all, so they stream from memory as in the engine) and the LM head. Prints milliseconds
(median of 7, the two kernels interleaved), GFLOPS and the speed ratio. The native kernel exists
on AVX2 machines without AVX-512 (kernels/ops/csrc/linear.c); elsewhere the script says so and stops.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from kvrelay.kernels import cpu_native, native_ops

HIDDEN, MLP, VOCAB, LAYERS = 512, 1376, 32000, 8
SHAPES = [(3 * HIDDEN, HIDDEN), (HIDDEN, HIDDEN), (2 * MLP, HIDDEN), (HIDDEN, MLP)]  # qkv, o, gate_up, down


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,38,64,512,2048")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_native.unavailable_reason() is not None or not cpu_native.packed_linear_available():
        raise SystemExit("no packed linear kernel on this machine (it needs AVX2 without AVX-512)")
    torch.manual_seed(0)
    layers = [[torch.randn(n, k) * 0.05 for n, k in SHAPES] for _ in range(LAYERS)]
    packed = [[native_ops.prepack_linear(w) for w in layer] for layer in layers]
    lm_head = torch.randn(VOCAB, HIDDEN) * 0.05
    lm_packed = native_ops.prepack_linear(lm_head)
    print(f"{LAYERS} layers of {', '.join(f'{n}x{k}' for n, k in SHAPES)} + LM head {VOCAB}x{HIDDEN}, "
          f"fp32, {args.threads} threads")
    print(f"{'rows':>5} | {'layers: torch':>14} {'native':>9} {'speed':>6} | {'LM head: torch':>15} {'native':>9} {'speed':>6}")
    for rows in map(int, args.rows.split(",")):
        compare(rows, layers, packed, lm_head, lm_packed)


def compare(rows: int, layers, packed, lm_head, lm_packed) -> None:
    xs = {k: torch.randn(rows, k) for k in (HIDDEN, MLP)}

    def torch_layers():
        for layer in layers:
            for w in layer:
                F.linear(xs[w.shape[1]], w)

    def native_layers():
        for layer in packed:
            for p in layer:
                native_ops.packed_linear(xs[p.data.shape[1]], p)

    runs = {name: [] for name in ("tl", "nl", "th", "nh")}
    for i in range(9):  # the first two rounds warm up
        got = {"tl": timed(torch_layers), "nl": timed(native_layers),
               "th": timed(lambda: F.linear(xs[HIDDEN], lm_head)),
               "nh": timed(lambda: native_ops.packed_linear(xs[HIDDEN], lm_packed))}
        if i >= 2:
            for name, s in got.items():
                runs[name].append(s)
    med = {name: statistics.median(v) for name, v in runs.items()}
    layer_flop = 2 * rows * LAYERS * sum(n * k for n, k in SHAPES)
    head_flop = 2 * rows * VOCAB * HIDDEN

    def cell(s: float, flop: int) -> str:
        return f"{s * 1e3:6.2f} ms ({flop / s / 1e9:4.0f} GF)"

    print(f"{rows:>5} | {cell(med['tl'], layer_flop)} {cell(med['nl'], layer_flop)} {med['tl'] / med['nl']:5.2f}x | "
          f"{cell(med['th'], head_flop)} {cell(med['nh'], head_flop)} {med['th'] / med['nh']:5.2f}x")

if __name__ == "__main__":
    main()
