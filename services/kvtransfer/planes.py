"""The built-in fast data planes by name (`--kv-transport mooncake | cuda-ipc`) and their fallback.

Each plane is one module behind GrpcKVTransport (kvrelay.kvtransfer.transport, where the hand-off
protocol lives): kvrelay.kvtransfer.mooncake (a transfer-engine region the prefill worker writes
into, any node) and kvrelay.kvtransfer.cuda_ipc (the prefill worker's GPU cache opened over CUDA
IPC, same node). A plane that cannot open, on either side, leaves the K/V inline on the gRPC
stream and counts why in kvrelay:kv_plane_fallbacks_total{plane, reason}; it never fails a request.
"""

from __future__ import annotations

import logging

from kvrelay.kvtransfer.layout import KVLayout
from kvrelay.kvtransfer.mooncake import PLANE as MOONCAKE
from kvrelay.kvtransfer.mooncake import MooncakeRegions, MooncakeWriter, PlaneUnavailable, RemoteTarget
from kvrelay.kvtransfer.shm import ShmArena
from kvrelay.kvtransfer.transport import GrpcKVTransport
from kvrelay.v1 import kv_pb2

log = logging.getLogger(__name__)

CUDA_IPC = "cuda-ipc"
BUILTIN = (MOONCAKE, CUDA_IPC)


def builtin_transport(name: str, layout: KVLayout, options, metrics, device) -> GrpcKVTransport:
    """Decode side: the gRPC transport with the named plane, or without it (counted) when the
    plane cannot open here."""
    plain = GrpcKVTransport(layout, options.max_message_bytes, options.handoff_timeout_s)
    if name == CUDA_IPC:
        from kvrelay.kvtransfer.cuda_ipc import CudaIpcSources

        if device.type != "cuda":
            return _fallback(plain, name, "cpu_cache", metrics,
                             "--kv-transport cuda-ipc needs a CUDA KV cache; this worker's is on the CPU")
        plain.cuda_ipc = CudaIpcSources(layout, device, options.node_name, metrics)
        return plain
    if name != MOONCAKE:
        raise ValueError(f"--kv-transport {name!r}: the built-in planes are {', '.join(BUILTIN)}")
    try:
        arena = ShmArena(options.kv_remote_bytes, options.kv_shm_dir)
    except (OSError, ValueError) as e:
        return _fallback(plain, name, "no_arena", metrics, str(e))
    try:
        regions = MooncakeRegions(arena, options.kv_mooncake_host, options.kv_mooncake_protocol)
    except PlaneUnavailable as e:
        arena.close()
        return _fallback(plain, name, "unavailable", metrics, str(e))
    metrics.track_shm_arena(arena)
    return GrpcKVTransport(layout, options.max_message_bytes, options.handoff_timeout_s, remote=regions)


def _fallback(transport: GrpcKVTransport, plane: str, reason: str, metrics, why: str) -> GrpcKVTransport:
    log.warning("%s data plane unavailable (%s): K/V travels inline on gRPC", plane, why)
    metrics.plane_fallbacks.labels(plane, reason).inc()
    return transport


def open_remote(writer: MooncakeWriter, offer: kv_pb2.RemoteRegion, nbytes: int, metrics) -> RemoteTarget | None:
    """Prefill side: the decode worker's offered region as a write target, or None (inline,
    counted) when this worker cannot write there."""
    try:
        target = writer.remote(offer, nbytes)
    except PlaneUnavailable as e:
        log.debug("remote plane refused: %s", e)
        metrics.plane_fallbacks.labels(offer.plane or MOONCAKE, e.reason).inc()
        return None
    metrics.plane_handoffs.labels(offer.plane).inc()
    return target
