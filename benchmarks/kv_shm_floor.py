"""Floor of a same-node K/V hand-off on this machine, to read benchmarks/disagg.py's shared-memory
GB/s against: the hand-off's data work with no framework around it.

Two processes pinned to two cores, each with a CPU KV cache of disagg.py's dummy model (5 layers,
4 KV heads of 64, blocks of 16 tokens, fp32). Per hand-off the prefill side copies a prompt's
blocks into a shared-memory region and hashes them (chunk_wire.place_chunk, as the prefill
worker does), sends a 64-byte frame on a blocking Unix socket; the decode side hashes the region
and scatters it into its blocks (the engine's native scatter_blocks), then answers one byte. No
asyncio, no gRPC, no engine thread: what is left is moving freshly written bytes from one core
to the other. The same steps in one process, on one core, are the baseline.

Back to back, the same few blocks stay in the caches between hand-offs ("hot"). A real hand-off
follows a prefill, which streams the model's weights (128 MB for disagg.py's dummy model) through
the caches and leaves the prompt's K/V, the region and the decode worker's free blocks in DRAM.
The "cold" column models that: before each hand-off both processes sweep a buffer of --cold-mib
MiB (default 64, twice the 32 MiB L3 of the VM this was written on), untimed.

    .venv/bin/python benchmarks/kv_shm_floor.py [--lengths 128,512,2048] [--runs 200] [--cold-mib 64]
"""

from __future__ import annotations

import argparse
import mmap
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from kvrelay.kernels import native_ops
from kvrelay.kvtransfer.chunk_wire import checksum, payload_pieces, place_chunk
from kvrelay.v1 import kv_pb2

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 5, 4, 64, 16
NUM_BLOCKS = 640
FRAME = struct.Struct("<QQQQ")  # offset, size, xxh3_64, MiB to sweep after the ack (0: hot)


class Sweeper:
    """Evicts this process's caches: writes every line of a buffer larger than the last-level cache."""

    def __init__(self):
        self._buf = np.zeros(0, dtype=np.uint8)

    def sweep(self, mib: int) -> None:
        if mib <= 0:
            return
        if self._buf.nbytes != mib << 20:
            self._buf = np.zeros(mib << 20, dtype=np.uint8)
        self._buf += 1


def make_cache() -> torch.Tensor:
    cache = torch.empty(LAYERS, 2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    cache.uniform_()  # every page touched, as the engine does at start
    return cache


def map_arena(path: str, size: int) -> np.ndarray:
    fd = os.open(path, os.O_RDWR)
    try:
        m = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    finally:
        os.close(fd)
    return np.frombuffer(m, dtype=np.uint8)


def place(cache: torch.Tensor, arena: np.ndarray, blocks: list[int]) -> tuple[int, int]:
    """Prefill side: the prompt's blocks into the region at 0; (size, hash)."""
    msg = place_chunk(kv_pb2.KVChunk(), payload_pieces(cache, blocks, 0, LAYERS), arena, 0)
    return msg.chunk.shm_size, msg.chunk.xxh3_64


def take(cache: torch.Tensor, arena: np.ndarray, blocks: torch.Tensor, size: int, digest: int) -> None:
    """Decode side: check the region's hash and scatter it into the reserved blocks."""
    view = arena[:size]
    if checksum(view) != digest:
        raise RuntimeError("hash mismatch")
    data = torch.from_numpy(view).view(torch.float32).reshape(LAYERS, 2, len(blocks), BLOCK, KV_HEADS, HEAD_DIM)
    native_ops.scatter_blocks(cache, blocks, data, 0, LAYERS)


def decode_side(sock_path: str, arena_path: str, arena_size: int) -> None:
    torch.set_num_threads(1)
    cache, arena = make_cache(), map_arena(arena_path, arena_size)
    server = socket.socket(socket.AF_UNIX)
    server.bind(sock_path)
    server.listen()
    print("ready", flush=True)
    conn, _ = server.accept()
    sweeper = Sweeper()
    while frame := conn.recv(FRAME.size, socket.MSG_WAITALL):
        _, size, digest, cold_mib = FRAME.unpack(frame)
        n = size // (LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * 4)
        take(cache, arena, torch.arange(NUM_BLOCKS - n, NUM_BLOCKS), size, digest)
        conn.sendall(b"k")
        if cold_mib:
            sweeper.sweep(cold_mib)
            conn.sendall(b"r")  # swept: the next hand-off may start


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="128,512,2048")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--cold-mib", type=int, default=64, help="MiB each process sweeps before a cold hand-off")
    ap.add_argument("--decode-side", nargs=3, help=argparse.SUPPRESS)  # internal: the second process
    args = ap.parse_args()
    if args.decode_side:
        sock_path, arena_path, arena_size = args.decode_side
        return decode_side(sock_path, arena_path, int(arena_size))
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    lengths = [int(x) for x in args.lengths.split(",")]
    arena_size = -(-max(lengths) // BLOCK) * LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM * 4
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        arena_path, sock_path = os.path.join(tmp, "arena"), os.path.join(tmp, "sock")
        with open(arena_path, "wb") as f:
            f.truncate(arena_size)
        cmd = [sys.executable, __file__, "--decode-side", sock_path, arena_path, str(arena_size)]
        if len(cores) > 1:
            cmd = ["taskset", "-c", str(cores[1]), *cmd]
            os.sched_setaffinity(0, {cores[0]})
        peer = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        try:
            peer.stdout.readline()
            conn = socket.socket(socket.AF_UNIX)
            conn.connect(sock_path)
            cache, arena = make_cache(), map_arena(arena_path, arena_size)
            local_cache = make_cache()  # the in-process baseline's decode cache
            sweeper = Sweeper()
            print(f"cores {cores}: prefill side on {cores[0]}, decode side on {cores[-1]}; {args.runs} hand-offs "
                  f"per size, medians")
            for n in lengths:
                blocks = list(range(-(-n // BLOCK)))
                ids = torch.arange(NUM_BLOCKS - len(blocks), NUM_BLOCKS)
                one_core, two_cores, cold = [], [], []
                for _ in range(args.runs):
                    t = time.perf_counter()
                    size, digest = place(cache, arena, blocks)
                    take(local_cache, arena, ids, size, digest)
                    one_core.append(time.perf_counter() - t)
                for samples, cold_mib in [(two_cores, 0)] + [(cold, args.cold_mib)] * (args.cold_mib > 0):
                    for _ in range(args.runs):
                        sweeper.sweep(cold_mib)
                        t = time.perf_counter()
                        size, digest = place(cache, arena, blocks)
                        conn.sendall(FRAME.pack(0, size, digest, cold_mib))
                        if conn.recv(1) != b"k":
                            raise RuntimeError("decode side gone")
                        samples.append(time.perf_counter() - t)
                        if cold_mib and conn.recv(1) != b"r":
                            raise RuntimeError("decode side gone")
                a, b = median_ms(one_core), median_ms(two_cores)
                line = (f"  {n:>5} tokens ({size / 1e6:5.1f} MB): one process {a:6.3f} ms ({size / a / 1e6:5.2f} GB/s), "
                        f"two processes {b:6.3f} ms ({size / b / 1e6:5.2f} GB/s), ratio {b / a:4.2f}x")
                if cold:
                    c = median_ms(cold)
                    line += f"; two processes, cold caches {c:6.3f} ms ({size / c / 1e6:5.2f} GB/s), {c / b:4.2f}x hot"
                print(line, flush=True)
            conn.close()
        finally:
            peer.terminate()
            peer.wait()


if __name__ == "__main__":
    main()
