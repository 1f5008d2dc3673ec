"""The API process <-> engine-core process message path: encodings, and a ZeroMQ round trip.

    .venv/bin/python benchmarks/engine_ipc.py [--outputs 64] [--iters 2000]

Encodes and decodes one step's RequestOutputs (--outputs of them, one token each, with metrics)
with pickle (what kvrelay.engine.core.protocol uses) and with msgpack plus the conversion of the
dataclasses to and from lists, and times a PUSH/PULL round trip of that message between two
processes over an ipc:// socket. Prints microseconds per step and the msgpack/pickle ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import pickle
import tempfile
import time

from kvrelay.engine.outputs import RequestMetrics, RequestOutput


def step_outputs(n: int) -> list[RequestOutput]:
    return [RequestOutput(f"cmpl-{i:032x}", 0, [1234], " word", None, None, None, 57, 12, 0,
                          RequestMetrics(1.0, 1.1, 1.2)) for i in range(n)]


def per_call_us(fn, iters: int) -> float:
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def msgpack_round(outs: list[RequestOutput]) -> list[RequestOutput]:
    import msgpack

    def enc(o):
        return [o.request_id, o.index, o.new_token_ids, o.text, None, o.finish_reason, o.stop_reason,
                o.num_prompt_tokens, o.num_generated_tokens, o.num_cached_tokens, dataclasses.astuple(o.metrics)]

    rows = msgpack.unpackb(msgpack.packb([enc(o) for o in outs]))
    return [RequestOutput(*r[:10], RequestMetrics(*r[10])) for r in rows]


def echo(address_in: str, address_out: str) -> None:
    import zmq

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(address_in)
    push.connect(address_out)
    while True:
        data = pull.recv()
        push.send(data)
        if data == b"stop":
            return


def round_trip_us(outs: list[RequestOutput], iters: int) -> float:
    import zmq

    d = tempfile.mkdtemp()
    a_in, a_out = f"ipc://{d}/in", f"ipc://{d}/out"
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(a_in)
    pull.bind(a_out)
    child = mp.get_context("spawn").Process(target=echo, args=(a_in, a_out))
    child.start()

    def once():
        push.send(pickle.dumps(outs, protocol=pickle.HIGHEST_PROTOCOL))
        pickle.loads(pull.recv())

    for _ in range(50):
        once()
    us = per_call_us(once, iters)
    push.send(b"stop")
    child.join(10)
    return us


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--outputs", type=int, default=64)
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args()
    outs = step_outputs(args.outputs)
    pk = per_call_us(lambda: pickle.loads(pickle.dumps(outs, protocol=pickle.HIGHEST_PROTOCOL)), args.iters)
    try:
        mp_us = per_call_us(lambda: msgpack_round(outs), args.iters)
        versus = f"msgpack+conversion {mp_us:.0f} us ({mp_us / pk:.2f}x pickle)"
    except ImportError:
        versus = "msgpack not installed (pip install msgpack to compare)"
    rt = round_trip_us(outs, args.iters)
    print(f"{args.outputs} outputs per step: pickle encode+decode {pk:.0f} us, {versus}; "
          f"ZeroMQ ipc round trip with pickle {rt:.0f} us")


if __name__ == "__main__":
    main()
