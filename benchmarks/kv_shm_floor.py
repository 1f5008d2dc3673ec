"""Floor of a same-node K/V hand-off on this machine, to read benchmarks/disagg.py's shared-memory
GB/s against: the hand-off's data work with no framework around it.

Two processes pinned to two cores, each with a CPU KV cache of disagg.py's dummy model (5 layers,
4 KV heads of 64, blocks of 16 tokens, fp32), a blocking Unix socket between them, and for each
hand-off a small frame one way and one byte back. No asyncio, no gRPC, no engine thread: what
is left is moving freshly written bytes from one core to the other. Two data paths, with the
workers' own functions:
  - region (the shm plane): the prefill side copies the prompt's blocks into a shared-memory
    region and hashes them (chunk_wire.place_chunk); the decode side hashes the region and
    scatters it into its blocks (the engine's native scatter_blocks);
  - direct (prefill --kv-shared-cache): the prefill side's cache is itself a shared-memory file;
    it sends the frame, then hashes the prompt's blocks in place and sends the hash, while the
    decode side copies them straight into its blocks from a read-only mapping and hashes what
    landed (layout.DirectChunk), then checks it against the hash.
The region path's steps in one process, on one core, are the baseline.

Back to back, the same few blocks stay in the caches between hand-offs ("hot"). A real hand-off
follows a prefill, which streams the model's weights (128 MB for disagg.py's dummy model) through
the caches and leaves the prompt's K/V, the region and the decode worker's free blocks in DRAM.
"Cold" models that: before each hand-off both processes sweep a buffer of --cold-mib MiB
(default 64, twice the 32 MiB L3 of the VM this was written on), untimed. The two paths take
turns hand-off by hand-off (all hot hand-offs, then all cold ones), so a change in the
machine's speed hits both alike.

    .venv/bin/python benchmarks/kv_shm_floor.py [--lengths 128,512,2048] [--runs 200] [--cold-mib 64]
"""

from __future__ import annotations

import argparse
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
from kvrelay.kvtransfer.chunk_wire import checksum, payload_pieces, pieces_checksum, place_chunk
from kvrelay.kvtransfer.layout import ChunkRange, DirectChunk, KVLayout
from kvrelay.kvtransfer.shm import DATA_START, SharedKVCache, ShmArena, SourceCaches, map_file
from kvrelay.v1 import kv_pb2

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 5, 4, 64, 16
NUM_BLOCKS = 640
LAYOUT = KVLayout("floor", "-", "float32", BLOCK, LAYERS, KV_HEADS, HEAD_DIM)
BLOCK_BYTES = LAYOUT.bytes_per_block_layer * LAYERS  # one block, all layers
FRAME = struct.Struct("<QQQQ")  # blocks, xxh3_64, direct (0/1), MiB to sweep after the ack (0: hot)
HASH = struct.Struct("<Q")  # direct: the xxh3_64, sent after the frame
MODES = (("region", False, False), ("region", False, True), ("direct", True, False), ("direct", True, True))


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


def make_cache(storage=None) -> torch.Tensor:
    shape = (LAYERS, 2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    cache = torch.empty(shape) if storage is None else storage(NUM_BLOCKS * BLOCK_BYTES).view(torch.float32).view(shape)
    cache.uniform_()  # every page touched, as the engine does at start
    return cache


def place(cache: torch.Tensor, region: np.ndarray, blocks: list[int]) -> int:
    """Prefill side, region path: the prompt's blocks into the region at 0; their hash."""
    return place_chunk(kv_pb2.KVChunk(), payload_pieces(cache, blocks, 0, LAYERS), region, 0).chunk.xxh3_64


def take(cache: torch.Tensor, region: np.ndarray, ids: torch.Tensor, digest: int) -> None:
    """Decode side, region path: check the region's hash and scatter it into the reserved blocks."""
    view = region[:len(ids) * BLOCK_BYTES]
    if checksum(view) != digest:
        raise RuntimeError("hash mismatch")
    data = torch.from_numpy(view).view(torch.float32).reshape(LAYERS, 2, len(ids), BLOCK, KV_HEADS, HEAD_DIM)
    native_ops.scatter_blocks(cache, ids, data, 0, LAYERS)


def map_region(path: str) -> np.ndarray:
    """Decode side: the region the prefill side places into (its arena file past the nonce page)."""
    return np.frombuffer(map_file(path, writable=True), dtype=np.uint8)[DATA_START:]


def decode_side(sock_path: str, region_path: str, cache_path: str, cache_nonce: str) -> None:
    torch.set_num_threads(1)
    cache, region = make_cache(), map_region(region_path)
    source = SourceCaches(LAYOUT).open(kv_pb2.ShmRegion(path=cache_path, nonce=bytes.fromhex(cache_nonce),
                                                        offset=DATA_START, size=NUM_BLOCKS * BLOCK_BYTES))
    server = socket.socket(socket.AF_UNIX)
    server.bind(sock_path)
    server.listen()
    print("ready", flush=True)
    conn, _ = server.accept()
    sweeper = Sweeper()
    while frame := conn.recv(FRAME.size, socket.MSG_WAITALL):
        n, digest, direct, cold_mib = FRAME.unpack(frame)
        ids = list(range(NUM_BLOCKS - n, NUM_BLOCKS))
        if direct:
            chunk = DirectChunk(ChunkRange(0, LAYERS, 0, n), source, list(range(n)))
            chunk.copy_into(cache, ids)
            chunk.check(HASH.unpack(conn.recv(HASH.size, socket.MSG_WAITALL))[0])  # sent while we copied
        else:
            take(cache, region, torch.tensor(ids), digest)
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
    ap.add_argument("--decode-side", nargs=4, help=argparse.SUPPRESS)  # internal: the second process
    args = ap.parse_args()
    if args.decode_side:
        return decode_side(*args.decode_side)
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    lengths = [int(x) for x in args.lengths.split(",")]
    modes = [m for m in MODES if args.cold_mib > 0 or not m[2]]
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as tmp:
        region_file = ShmArena(DATA_START + -(-max(lengths) // BLOCK) * BLOCK_BYTES, tmp)
        region = region_file.view[DATA_START:]
        shared = SharedKVCache(tmp)
        cache = make_cache(shared)  # the prefill side's, in a shared file for the direct path
        sock_path = os.path.join(tmp, "sock")
        cmd = [sys.executable, __file__, "--decode-side", sock_path, str(region_file.path), str(shared.arena.path),
               shared.arena.nonce.hex()]
        if len(cores) > 1:
            cmd = ["taskset", "-c", str(cores[1]), *cmd]
            os.sched_setaffinity(0, {cores[0]})
        peer = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        try:
            peer.stdout.readline()
            conn = socket.socket(socket.AF_UNIX)
            conn.connect(sock_path)
            local_cache = make_cache()  # the in-process baseline's decode cache
            sweeper = Sweeper()
            print(f"cores {cores}: prefill side on {cores[0]}, decode side on {cores[-1]}; {args.runs} hand-offs "
                  f"per size and configuration, medians")
            for n in lengths:
                blocks = list(range(-(-n // BLOCK)))
                size = len(blocks) * BLOCK_BYTES
                ids = torch.arange(NUM_BLOCKS - len(blocks), NUM_BLOCKS)
                one_core: list[float] = []
                for _ in range(args.runs):
                    t = time.perf_counter()
                    take(local_cache, region, ids, place(cache, region, blocks))
                    one_core.append(time.perf_counter() - t)
                samples: dict[tuple, list[float]] = {m: [] for m in modes}
                # Hot runs together (a cold run's sweep would leave the next one cold), then cold.
                turns = [m for cold in (False, True) for _ in range(args.runs) for m in modes if m[2] == cold]
                for mode in turns:
                    _, direct, cold = mode
                    cold_mib = args.cold_mib if cold else 0
                    sweeper.sweep(cold_mib)
                    t = time.perf_counter()
                    if direct:  # the frame first, then the hash, as the prefill worker does
                        conn.sendall(FRAME.pack(len(blocks), 0, direct, cold_mib))
                        conn.sendall(HASH.pack(pieces_checksum(payload_pieces(cache, blocks, 0, LAYERS))))
                    else:
                        conn.sendall(FRAME.pack(len(blocks), place(cache, region, blocks), direct, cold_mib))
                    if conn.recv(1) != b"k":
                        raise RuntimeError("decode side gone")
                    samples[mode].append(time.perf_counter() - t)
                    if cold_mib and conn.recv(1) != b"r":
                        raise RuntimeError("decode side gone")
                a = median_ms(one_core)
                cells = [f"one process {a:6.3f} ms ({size / a / 1e6:5.2f} GB/s)"]
                for (name, _, cold), got in samples.items():
                    ms = median_ms(got)
                    cells.append(f"{name} {'cold' if cold else 'hot'} {ms:6.3f} ms ({size / ms / 1e6:5.2f} GB/s)")
                line = f"  {n:>5} tokens ({size / 1e6:5.1f} MB): " + ", ".join(cells)
                for cold in {m[2] for m in modes}:
                    r, d = median_ms(samples[("region", False, cold)]), median_ms(samples[("direct", True, cold)])
                    line += f"; direct vs region {'cold' if cold else 'hot'} {r / d:4.2f}x"
                print(line, flush=True)
            conn.close()
        finally:
            peer.terminate()
            peer.wait()
            shared.close()
            region_file.close()


if __name__ == "__main__":
    main()
