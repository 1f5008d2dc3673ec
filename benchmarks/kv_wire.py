"""Ceilings for the KV hand-off on this machine, to read benchmarks/disagg.py's GB/s against.

  - checksum speed over a 64 MiB buffer: zlib's CRC32 (what chunks carried before) and XXH3-64
    (what they carry now);
  - a bare gRPC (grpc.aio) stream between two processes sending prebuilt messages of
    --message-mib, with no KV work at all: what one hand-off stream could move at best.

    .venv/bin/python benchmarks/kv_wire.py [--message-mib 4] [--stream-mib 1024] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
import zlib

import grpc
import xxhash

OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
METHOD = "/bench.Bulk/Stream"


def _identity(b: bytes) -> bytes:
    return b


def checksum_speeds() -> None:
    data = os.urandom(64 << 20)
    for name, fn in (("zlib.crc32", zlib.crc32), ("xxh3_64", xxhash.xxh3_64_intdigest)):
        fn(data)
        t0 = time.perf_counter()
        fn(data)
        print(f"{name:10s} {len(data) / (time.perf_counter() - t0) / 1e9:6.2f} GB/s")


async def serve(message_mib: int, stream_mib: int) -> None:
    payload = os.urandom(message_mib << 20)

    async def stream(requests, context):
        async for _ in requests:  # one request starts the stream
            break
        for _ in range(max(1, stream_mib // message_mib)):
            await context.write(payload)

    handler = grpc.method_handlers_generic_handler("bench.Bulk", {"Stream": grpc.stream_stream_rpc_method_handler(
        stream, request_deserializer=_identity, response_serializer=_identity)})
    server = grpc.aio.server(options=OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


async def pull(port: int, runs: int, message_mib: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OPTIONS) as channel:
        method = channel.stream_stream(METHOD, request_serializer=_identity, response_deserializer=_identity)
        for run in range(runs):
            call = method()
            await call.write(b"go")
            received = 0
            t0 = time.perf_counter()
            while (msg := await call.read()) is not grpc.aio.EOF:
                received += len(msg)
            seconds = time.perf_counter() - t0
            print(f"bare gRPC stream, {message_mib} MiB messages, run {run + 1}: {received / 2**20:.0f} MiB "
                  f"in {seconds * 1000:.0f} ms = {received / seconds / 1e9:.2f} GB/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--message-mib", type=int, default=4)
    p.add_argument("--stream-mib", type=int, default=1024, help="MiB per stream")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        return asyncio.run(serve(args.message_mib, args.stream_mib))
    checksum_speeds()
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--message-mib", str(args.message_mib),
                               "--stream-mib", str(args.stream_mib)], stdout=subprocess.PIPE, text=True)
    try:
        asyncio.run(pull(int(server.stdout.readline()), args.runs, args.message_mib))
    finally:
        server.kill()


if __name__ == "__main__":
    main()
