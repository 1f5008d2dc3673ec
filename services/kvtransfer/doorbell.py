"""The doorbell: the control path of a same-node hand-off, from engine thread to engine thread.

On the shared-memory data plane (kvrelay.kvtransfer.shm) the K/V bytes no longer travel on the
gRPC stream, but each chunk's header, PrefillDone and the ack still did, and each of those
messages crossed asyncio and gRPC on both sides plus a hop between each worker's event loop and
its engine thread: about 2 ms of a 128-token hand-off whose bytes take 0.6 ms to move
(benchmarks/kv_shm_floor.py). The doorbell is a Unix socket beside the decode worker's arena:

- the prefill worker's engine thread places chunks in the region and rings (DoorbellFrame:
  their headers, and PrefillDone on the last frame) right after the step that produced them (for
  a GPU cache, a ringer thread does, once the copy stream has the chunk in pinned memory);
- a thread of the decode worker reads the frame, verifies it and copies the chunks into the
  reserved blocks itself (LLMEngine.write_reserved: no hop to the engine thread, and an abort
  waits for the copy), then acks on the socket (DoorbellAck) once the last frame's chunks are in;
- a thread of the prefill worker reads the ack and hands it to the hand-off.

The CUDA IPC plane (kvrelay.kvtransfer.cuda_ipc) rings the same way, from a decode worker's
socket beside an empty locked file (shm.LockedFile) instead of an arena: its frames carry the
headers with each chunk's held blocks and GPU checksum, and the cache's IPC handle; the decode
worker's thread copies device to device and checks before it acks.

Everything else stays on the gRPC stream: start, header, aborts both ways, the stream's end as
the sign of a dead peer, and a second ack from the decode worker's event loop (in case the
socket's ack is lost). Sends never block: a peer that stops reading loses its connection, and
the hand-offs that depended on it fail over the gRPC stream like any other failure.

Frames: a 4-byte little-endian length, then the protobuf message (kv.proto).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvrelay.kvtransfer.errors import ChunkError, HandoffError
from kvrelay.kvtransfer.layout import DirectChunk, ReceivedChunk
from kvrelay.v1 import kv_pb2

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 20  # frames hold headers only: a 4k-token prompt's last frame is ~2 KB


def encode_frame(msg) -> bytes:
    body = msg.SerializeToString()
    return _LENGTH.pack(len(body)) + body


def send_nowait(sock: socket.socket, data: bytes) -> bool:
    """Send all of data without blocking; False if the socket is broken or its buffer is full
    (the peer stopped reading): the caller then closes it, since a partial frame may be out."""
    try:
        return sock.send(data, socket.MSG_DONTWAIT) == len(data)
    except OSError:
        return False


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def read_frames(sock: socket.socket):
    """Yield each frame's body until the peer closes; raises ConnectionError on a malformed length."""
    while True:
        head = _recv_exact(sock, _LENGTH.size)
        if head is None:
            return
        (n,) = _LENGTH.unpack(head)
        if n > MAX_FRAME_BYTES:
            raise ConnectionError(f"doorbell frame of {n} B is over the {MAX_FRAME_BYTES} B limit")
        body = _recv_exact(sock, n)
        if body is None:
            return
        yield body


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on it
    sock.close()


# ---- decode side ------------------------------------------------------------------------------


@dataclass(eq=False)
class DoorbellHandoff:
    """Decode side: one hand-off that expects its chunks on the doorbell.

    accept verifies a chunk header of a frame (and the frame's source: the prefill worker's shared
    cache for a direct chunk, its CUDA IPC handle for one of that plane) and returns the chunk
    (raises ChunkError); check_complete
    proves every (layer, block) arrived; write checks the chunks' checksums and copies them into
    the reserved blocks (raises if the request no longer holds them). future resolves on the
    event loop with the last frame's PrefillDone once everything is written, or with the error."""

    ticket: bytes
    accept: Callable[[kv_pb2.KVChunk, kv_pb2.DoorbellFrame], ReceivedChunk | DirectChunk]  # (chunk, its frame)
    check_complete: Callable[[], None]
    write: Callable[[list[ReceivedChunk | DirectChunk]], None]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future  # of kv_pb2.PrefillDone
    # Blocks until the destination blocks are reserved (an early start); raises if they never
    # will be. Called before the lock, so a transport giving up never waits for a reservation.
    ready: Callable[[], None] | None = None
    first_chunk_at: float | None = None
    written_at: float | None = None
    live: bool = True  # False once the transport gave the hand-off up: later frames are dropped
    lock: threading.Lock = field(default_factory=threading.Lock)
    unchecked: collections.deque = field(default_factory=collections.deque)  # direct chunks awaiting checksums

    def resolve(self, value: kv_pb2.PrefillDone | BaseException) -> None:
        """From any thread; the first outcome wins."""
        self.loop.call_soon_threadsafe(_settle, self.future, value)

    def give_up(self) -> None:
        """The transport stops waiting: once this returns, no write is running or will start
        (event loop thread). An outcome that still comes is dropped, not reported as unread."""
        with self.lock:
            self.live = False
        self.future.add_done_callback(lambda f: f.cancelled() or f.exception())


def _settle(fut, value) -> None:
    if fut.done():
        return
    if isinstance(value, BaseException):
        fut.set_exception(value)
    else:
        fut.set_result(value)


class DoorbellServer:
    """Decode side: listens on a Unix socket beside the arena; one reader thread per prefill
    worker that connects, which verifies, writes and acks its frames."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._handoffs: dict[bytes, DoorbellHandoff] = {}
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._closed = False
        self.path.unlink(missing_ok=True)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(str(self.path))
            os.chmod(self.path, 0o600)  # like the arena: only the workers' own user may ring
            self._sock.listen(64)
        except OSError:
            self._sock.close()
            raise
        self._thread = threading.Thread(target=self._accept_loop, name="kvrelay-doorbell", daemon=True)
        self._thread.start()

    def register(self, handoff: DoorbellHandoff) -> None:
        with self._lock:
            self._handoffs[handoff.ticket] = handoff

    def unregister(self, handoff: DoorbellHandoff) -> None:
        handoff.give_up()
        with self._lock:
            if self._handoffs.get(handoff.ticket) is handoff:
                del self._handoffs[handoff.ticket]

    def close(self) -> None:
        self._closed = True
        self.path.unlink(missing_ok=True)
        _close(self._sock)
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            _close(conn)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kvrelay-doorbell-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            for body in read_frames(conn):
                self._on_frame(conn, kv_pb2.DoorbellFrame.FromString(body))
        except Exception as e:  # noqa: BLE001 - a bad peer loses its connection, not the worker
            if not self._closed:
                log.warning("doorbell connection dropped: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            _close(conn)

    def _on_frame(self, conn: socket.socket, frame: kv_pb2.DoorbellFrame) -> None:
        with self._lock:
            h = self._handoffs.get(frame.ticket)
        if h is None:
            return  # a hand-off the transport already gave up (it told the prefill worker on gRPC)
        done = frame.done if frame.HasField("done") else None
        if h.ready is not None:
            try:
                h.ready()
            except Exception as e:  # noqa: BLE001 - the reservation failed or was given up
                h.resolve(e)
                return
        with h.lock:  # the transport's give_up waits for the write
            if not h.live:
                return
            try:
                chunks = [h.accept(c, frame) for c in frame.chunks]
                if chunks and h.first_chunk_at is None:
                    h.first_chunk_at = time.monotonic()
                if done is not None:
                    h.check_complete()
            except HandoffError as e:
                h.resolve(e)
                return
            except Exception as e:  # noqa: BLE001 - e.g. a header that does not parse as a layout
                h.resolve(ChunkError(f"bad doorbell frame: {e}"))
                return
            try:
                if chunks:
                    h.write(chunks)
                h.unchecked.extend(c for c in chunks if isinstance(c, DirectChunk) and c.awaits_checksum)
                for xxh3_64 in frame.checksums:
                    if not h.unchecked:
                        raise ChunkError("a doorbell frame carries a checksum for no direct KV chunk")
                    h.unchecked.popleft().check(xxh3_64)
                if done is not None and h.unchecked:
                    raise ChunkError(f"{len(h.unchecked)} direct KV chunks never got their checksums")
            except Exception as e:  # noqa: BLE001 - handed to the transport, which aborts the hand-off
                h.resolve(e)
                return
        if done is not None:
            h.written_at = time.monotonic()
            # Settle before acking: the ack lets the prefill worker end the gRPC stream, and the
            # stream's end, seen first on the event loop, would otherwise fail a complete hand-off.
            h.resolve(done)
            self._ack(conn, h)

    def _ack(self, conn: socket.socket, h: DoorbellHandoff) -> None:
        ack = kv_pb2.DoorbellAck(ticket=h.ticket, written_at_ns=int(h.written_at * 1e9))
        send_nowait(conn, encode_frame(ack))  # if lost, the stream's ack follows


# ---- prefill side -----------------------------------------------------------------------------

# (ticket, when this worker read the ack, when the decode worker wrote the last chunk or None),
# both time.monotonic() values: one clock on one node.
AckCallback = Callable[[bytes, float, float | None], None]


class DoorbellConn:
    """Prefill side: a connection to one decode worker's doorbell."""

    def __init__(self, path: str, sock: socket.socket, on_ack: AckCallback,
                 on_close: Callable[[DoorbellConn], None]):
        self.path = path
        self._sock = sock
        self._on_ack = on_ack
        self._on_close = on_close
        self._send_lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._read_acks, name="kvrelay-doorbell-acks", daemon=True).start()

    def ring(self, frame: kv_pb2.DoorbellFrame) -> bool:
        """Send a frame without blocking (any thread); False if the connection is (now) closed."""
        data = encode_frame(frame)
        with self._send_lock:
            if self.closed:
                return False
            if send_nowait(self._sock, data):
                return True
        self.close()
        return False

    def close(self) -> None:
        with self._send_lock:
            if self.closed:
                return
            self.closed = True
        _close(self._sock)
        self._on_close(self)

    def _read_acks(self) -> None:
        try:
            for body in read_frames(self._sock):
                read_at, ack = time.monotonic(), kv_pb2.DoorbellAck.FromString(body)
                self._on_ack(ack.ticket, read_at, ack.written_at_ns / 1e9 if ack.written_at_ns else None)
        except Exception as e:  # noqa: BLE001 - the gRPC stream still carries the ack
            if not self.closed:
                log.warning("doorbell connection to %s dropped: %s", self.path, e)
        finally:
            self.close()


class DoorbellClient:
    """Prefill side: connections to decode workers' doorbells, one per socket path, reused."""

    def __init__(self, on_ack: AckCallback):
        self._on_ack = on_ack
        self._conns: dict[str, DoorbellConn] = {}
        self._lock = threading.Lock()

    def connect(self, path: str) -> DoorbellConn | None:
        """The open connection to path, or a new one; None when this worker cannot reach it."""
        with self._lock:
            conn = self._conns.get(path)
            if conn is not None and not conn.closed:
                return conn
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(1.0)
            sock.connect(path)
            sock.settimeout(None)
        except OSError:
            sock.close()
            return None
        conn = DoorbellConn(path, sock, self._on_ack, self._forget)
        with self._lock:
            self._conns[path] = conn
        return conn

    def _forget(self, conn: DoorbellConn) -> None:
        with self._lock:
            if self._conns.get(conn.path) is conn:
                del self._conns[conn.path]

    def close(self) -> None:
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            conn.close()

