"""The Mooncake plane's two write paths on loopback TCP (kvrelay.kvtransfer.mooncake.RemoteTarget):
a CPU cache's block views written where they lie ("pieces": one batched write, XXH3 of the
blocks) against the staging path RDMA and GPU-gathered chunks take ("staged": copied into a
registered buffer, hashed, one write). One 4 MiB chunk of 10 block runs per write, interleaved,
median of the middle 11 of 15, ratio in the same run.

    .venv/bin/python benchmarks/mooncake_write.py [--chunk-mib 4] [--reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import torch
from kvrelay.kvtransfer.mooncake import MooncakeRegions, MooncakeWriter
from kvrelay.kvtransfer.shm import ShmArena
from kvrelay.v1 import kv_pb2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunk-mib", type=int, default=4)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    block = args.chunk_mib * 2**20 // 10 // 10  # 10 runs of 10 blocks
    cache = np.random.default_rng(0).integers(0, 256, size=(5, 2, 64, block), dtype=np.uint8)
    pieces = [cache[layer, kv, 0:10] for layer in range(5) for kv in (0, 1)]
    size = sum(p.nbytes for p in pieces)
    with tempfile.TemporaryDirectory() as tmp:
        arena = ShmArena(4 * size + 2**20, tmp)
        regions = MooncakeRegions(arena, "127.0.0.1")
        writer = MooncakeWriter("127.0.0.1")
        times: dict[str, list[float]] = {"pieces": [], "staged": []}
        gathered = torch.from_numpy(np.concatenate([p.reshape(-1) for p in pieces]))
        for _ in range(args.reps):
            for mode, v in times.items():
                region = arena.allocate(size)
                target = writer.remote(regions.offer(region), size)
                start = time.perf_counter()
                target.place(kv_pb2.KVChunk(), pieces if mode == "pieces" else gathered)
                v.append(time.perf_counter() - start)
                arena.free(region)
        regions.close()
    rate = {m: size / statistics.median(sorted(v)[2:-2]) / 1e9 for m, v in times.items()}
    print(f"{size / 2**20:.1f} MiB chunk: pieces {rate['pieces']:.2f} GB/s, staged {rate['staged']:.2f} GB/s, "
          f"pieces/staged {rate['pieces'] / rate['staged']:.2f}x")


if __name__ == "__main__":
    main()
