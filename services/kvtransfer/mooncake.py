"""Mooncake Transfer Engine data plane: the prefill worker writes the K/V into memory the decode
worker registered, on any node (RDMA where the node has it, TCP elsewhere).

The decode worker keeps an arena (kvrelay.kvtransfer.shm.ShmArena: the same first-fit allocator
of regions) whose memory is registered with its transfer engine once, and for each hand-off
offers a region of it in PrefillStart.remote (its engine's session "host:port", the region's
address and size). A prefill worker that can open a transfer engine answers
HandoffHeader.remote = true and, for each chunk, writes the bytes into the region with one
synchronous transfer, and only then sends the chunk's header on the gRPC stream, with
shm_offset/shm_size relative to the region, as on the shared-memory plane. Over TCP from a CPU
cache the engine reads the held blocks where they lie (one batch of writes, XXH3 of the blocks);
otherwise (RDMA, which reads only registered memory, or a chunk gathered off a GPU) the bytes are
first placed in a staging buffer registered with its engine (XXH3 of the placed bytes). From there
the decode worker treats the chunk exactly as a shared-memory one: it checks the range and the
checksum and copies into its reserved blocks on its engine thread, and the region's quarantine
after an unconfirmed abort covers a transfer still in flight. Writes into a worker's KV cache stay
its own; the remote writes only ever land in the region handed out for this hand-off.

Any failure to open the plane (the package missing, an engine that will not start, a peer it
cannot reach) sends the K/V inline on the stream instead, counted in
kvrelay:kv_plane_fallbacks_total{plane="mooncake", reason}. The package is
`mooncake-transfer-engine` (CUDA builds) or `mooncake-transfer-engine-non-cuda`; it needs Debian's
libibverbs1 to import even for TCP.
"""

from __future__ import annotations

import logging
import socket
import threading

import numpy as np
import torch
from kvrelay.kvtransfer.chunk_wire import Payload, payload_size, pieces_checksum, place_chunk
from kvrelay.kvtransfer.shm import Region, ShmArena
from kvrelay.v1 import kv_pb2

log = logging.getLogger(__name__)

PLANE = "mooncake"
PROTOCOLS = ("tcp", "rdma")
# Metadata exchange between the two engines without a metadata server: each engine's RPC port
# answers the peer's handshake (the session is "host:rpc_port").
METADATA = "P2PHANDSHAKE"


class PlaneUnavailable(RuntimeError):
    """The data plane cannot be opened here; hand-offs go inline on the gRPC stream."""

    def __init__(self, message: str, reason: str = "unavailable"):
        super().__init__(message)
        self.reason = reason  # the label of kvrelay:kv_plane_fallbacks_total


def default_host() -> str:
    """This host's address as its hostname resolves (a pod's IP in Kubernetes), else loopback."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def open_engine(host: str, protocol: str, device: str = ""):
    """A started transfer engine listening on host (the address peers reach this worker at)."""
    if protocol not in PROTOCOLS:
        raise PlaneUnavailable(f"mooncake protocol {protocol!r}: expected one of {', '.join(PROTOCOLS)}")
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise PlaneUnavailable(f"the Mooncake transfer engine does not import ({e}): install "
                               f"mooncake-transfer-engine (or -non-cuda) and Debian's libibverbs1") from None
    engine = TransferEngine()
    rc = engine.initialize(host, METADATA, protocol, device)
    if rc != 0:
        raise PlaneUnavailable(f"the Mooncake transfer engine did not start on {host!r} over {protocol} "
                               f"(initialize returned {rc})")
    return engine


class MooncakeRegions:
    """Decode side: an arena's memory registered with a transfer engine, its regions offered as
    PrefillStart.remote."""

    def __init__(self, arena: ShmArena, host: str = "", protocol: str = "tcp", engine=None):
        host = host or default_host()
        self.arena = arena
        self.protocol = protocol
        self.engine = engine or open_engine(host, protocol)
        self.address = int(arena.view.ctypes.data)
        rc = self.engine.register_memory(self.address, arena.size)
        if rc != 0:
            raise PlaneUnavailable(f"the Mooncake transfer engine could not register the {arena.size} B arena "
                                   f"(register_memory returned {rc})")
        self.session = f"{host}:{self.engine.get_rpc_port()}"

    def offer(self, region: Region) -> kv_pb2.RemoteRegion:
        return kv_pb2.RemoteRegion(plane=PLANE, session=self.session, protocol=self.protocol,
                                   address=self.address + region.offset, size=region.size)

    def close(self) -> None:
        if self.address:
            self.engine.unregister_memory(self.address)
            self.address = 0
            self.arena.close()


class MooncakeWriter:
    """Prefill side: one transfer engine per protocol (started at the first offer that asks for
    it) and a staging buffer registered with it; remote() opens one hand-off's target."""

    def __init__(self, host: str = ""):
        self.host = host or default_host()
        self._engines: dict[str, object] = {}
        # Sessions a write failed to (a decode worker gone, or one that named an address this
        # worker cannot reach): their later offers are answered inline instead of failing again.
        self._unreachable: set[str] = set()
        self._failed: dict[str, str] = {}  # protocol -> why its engine did not start (not retried)
        self._staging: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()  # one write at a time per staging buffer

    def remote(self, offer: kv_pb2.RemoteRegion, nbytes: int) -> RemoteTarget:
        """The offered region as a write target for nbytes of K/V; PlaneUnavailable when this
        worker cannot write there (the caller sends inline and counts why)."""
        if offer.plane != PLANE:
            raise PlaneUnavailable(f"remote plane {offer.plane!r} is not {PLANE!r}")
        if offer.size < nbytes:
            raise PlaneUnavailable(f"the offered region holds {offer.size} B, the hand-off needs {nbytes} B")
        if offer.session in self._unreachable:
            raise PlaneUnavailable(f"an earlier write to {offer.session} failed", reason="unreachable")
        return RemoteTarget(self, self._engine(offer.protocol or "tcp"), offer)

    def _engine(self, protocol: str):
        with self._lock:
            if protocol in self._failed:
                raise PlaneUnavailable(self._failed[protocol])
            if protocol not in self._engines:
                try:
                    self._engines[protocol] = open_engine(self.host, protocol)
                except PlaneUnavailable as e:
                    self._failed[protocol] = str(e)
                    log.warning("%s: K/V goes inline on gRPC", e)
                    raise
            return self._engines[protocol]

    def staging(self, engine, protocol: str, nbytes: int) -> np.ndarray:
        """A registered buffer of at least nbytes (call with self._lock held)."""
        buf = self._staging.get(protocol)
        if buf is None or buf.nbytes < nbytes:
            if buf is not None:
                engine.unregister_memory(int(buf.ctypes.data))
            buf = np.empty(max(nbytes, 1 << 20), dtype=np.uint8)
            rc = engine.register_memory(int(buf.ctypes.data), buf.nbytes)
            if rc != 0:
                raise ConnectionError(f"Mooncake could not register a {buf.nbytes} B staging buffer ({rc})")
            self._staging[protocol] = buf
        return buf


class RemoteTarget:
    """One hand-off's region on the decode worker: chunks land back to back from its start."""

    def __init__(self, writer: MooncakeWriter, engine, offer: kv_pb2.RemoteRegion):
        self.writer, self.engine, self.offer = writer, engine, offer
        self.next = 0

    def place(self, header: kv_pb2.KVChunk, data: Payload) -> kv_pb2.PrefillServerMessage:
        """Write one chunk's bytes into the region (blocking: call it off the event loop) and
        return its message, to send only now that the bytes are there."""
        size = payload_size(data)
        if self.next + size > self.offer.size:
            raise ValueError(f"chunk of {size} B does not fit the remote region at {self.next}")
        w = self.writer
        protocol = self.offer.protocol or "tcp"
        if protocol == "tcp" and not isinstance(data, torch.Tensor):
            return self._place_pieces(header, data, size)
        with w._lock:
            buf = w.staging(self.engine, protocol, size)
            msg = place_chunk(header, data, buf, 0)  # xxh3_64 of the placed bytes
            rc = self.engine.transfer_sync_write(self.offer.session, int(buf.ctypes.data),
                                                 self.offer.address + self.next, size)
        if rc != 0:
            self._fail(size, rc)
        msg.chunk.shm_offset = self.next
        self.next += size
        return msg

    def _fail(self, size: int, rc: int) -> None:
        unreachable = self.writer._unreachable
        if len(unreachable) > 4096:  # sessions of dead decode workers: bounded
            unreachable.clear()
        unreachable.add(self.offer.session)
        raise ConnectionError(f"Mooncake write of {size} B to {self.offer.session} failed ({rc}): the decode worker "
                              f"is gone or unreachable at that address (--kv-mooncake-host)")

    def _place_pieces(self, header: kv_pb2.KVChunk, pieces: list[np.ndarray], size: int) -> kv_pb2.PrefillServerMessage:
        """TCP from a CPU cache: the engine reads the held blocks' views where they lie (TCP needs
        no registered source), so the bytes are copied once, into the socket, instead of twice."""
        header.xxh3_64 = pieces_checksum(pieces)
        addrs, dests, lengths, at = [], [], [], self.offer.address + self.next
        for piece in pieces:
            addrs.append(int(piece.ctypes.data))
            dests.append(at)
            lengths.append(piece.nbytes)
            at += piece.nbytes
        rc = self.engine.batch_transfer_sync_write(self.offer.session, addrs, dests, lengths)
        if rc != 0:
            self._fail(size, rc)
        header.shm_offset, header.shm_size = self.next, size
        self.next += size
        return kv_pb2.PrefillServerMessage(chunk=header)
