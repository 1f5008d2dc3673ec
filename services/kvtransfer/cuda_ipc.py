"""CUDA IPC data plane: a decode and a prefill worker on one node with GPU caches move K/V device
to device, never through the host.

The decode worker (`--kv-transport cuda-ipc`) offers the plane in PrefillStart.cuda_ipc with its
node. A prefill worker on that node whose cache is on a GPU answers with its cache's CUDA IPC
handle (torch's CUDA storage sharing: the same handle for every hand-off) in HandoffHeader.cuda_ipc
and, per chunk, the held blocks that hold the chunk's range (source_block_ids) and a checksum of
their bytes in gather order computed on its GPU (device_checksum). The decode worker opens the
handle once per prefill cache, and on its engine thread copies the held blocks straight into its
reserved ones (one index copy per chunk, peer to peer across GPUs), then checksums what landed on
its GPU and compares (IpcChunk). As on the direct shared-memory hand-off, only the copied bytes
prove anything, writes into each cache stay its own worker's, and the reservation is unused until
the hand-off completes, so a chunk that fails the check leaves nothing behind.

A prefill worker that cannot answer (CPU cache, another node) leaves the K/V inline on the stream;
a decode worker that cannot open a handle fails that hand-off over (retry, local prefill) and
offers that prefill worker the plane no more. Both are counted in
kvrelay:kv_plane_fallbacks_total{plane="cuda-ipc", reason}.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading

import numpy as np
import torch
from kvrelay.kvtransfer.chunk_wire import Payload, payload_arrays
from kvrelay.kvtransfer.errors import ChunkError
from kvrelay.kvtransfer.layout import ChunkVerifier, DirectChunk, KVLayout
from kvrelay.v1 import kv_pb2

log = logging.getLogger(__name__)

PLANE = "cuda-ipc"
_MASK = (1 << 64) - 1
K1, K2 = 0x9E3779B97F4A7C15 - (1 << 64), 0xC2B2AE3D27D4EB4F - (1 << 64)  # the weights' constants, as int64
_SLICE = 1 << 24  # words per reduction: bounds the temporaries at ~400 MB


def device_checksum(t: torch.Tensor) -> int:
    """A 64-bit checksum of a contiguous tensor's bytes, computed where the tensor lives (no copy
    to the host): sum over its 32-bit words of word * w(i) mod 2**64, with an odd weight w(i)
    mixed from the word's index. Any single flipped bit changes it, and so does moving a word."""
    return checksum_int(device_checksum_tensor(t))


def checksum_int(t: torch.Tensor) -> int:
    """A checksum tensor (int64 scalar) as the unsigned number the wire carries."""
    return int(t.item()) & _MASK


def device_checksum_tensor(t: torch.Tensor) -> torch.Tensor:
    """device_checksum as an int64 scalar on t's device, launched on the current stream without
    waiting for it (the prefill worker's copy stream reads it back with the chunk)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.numel() % 4:
        raw = torch.cat([raw, raw.new_zeros(4 - raw.numel() % 4)])
    words = raw.view(torch.int32)
    if words.is_cuda:  # one pass in Triton (kvrelay.kernels.triton_checksum), the same number
        from kvrelay.kernels.triton_checksum import checksum

        return checksum(words, K1, K2)
    return torch_checksum(words)


def torch_checksum(words: torch.Tensor) -> torch.Tensor:
    """The definition, in torch ops over int64 temporaries (the CPU path, and the GPU kernel's reference)."""
    acc = torch.zeros((), dtype=torch.int64, device=words.device)
    for lo in range(0, words.numel(), _SLICE):
        w = words[lo:lo + _SLICE].to(torch.int64) & 0xFFFFFFFF
        idx = torch.arange(lo, lo + w.numel(), dtype=torch.int64, device=words.device)
        weight = ((idx * K1) ^ ((idx * K2) >> 29)) | 1  # int64 products wrap, alike on CPU and GPU
        acc += (w * weight).sum()
    return acc


def fused_copy(source: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether kvrelay.kernels.triton_checksum.block_checksum can read source's blocks (and copy
    them into cache): both on one GPU, contiguous, blocks of whole 32-bit words."""
    from kvrelay.kernels.triton_checksum import block_words

    words = block_words(source)
    return source.is_cuda and source.device == cache.device and words is not None and words == block_words(cache)


class IpcChunk(DirectChunk):
    """A chunk whose bytes are blocks source_ids of the prefill worker's cache, opened over CUDA
    IPC: copy_into copies them into the reservation and checks the checksum of what landed
    against the prefill worker's (carried by the chunk), raising ChunkError on a mismatch."""

    expected: int = 0
    awaits_checksum = False  # it came with the header: copy_into checks it

    def copy_into(self, kv_cache: torch.Tensor, block_ids: list[int]) -> None:
        """On the calling thread's current stream of the cache's device: the engine thread's, or
        a doorbell thread's, which is the same legacy default stream, so the copy is ordered after
        every step already launched (one may still write a block freed into this reservation)."""
        r = self.range
        on_gpu = torch.cuda.device(kv_cache.device) if kv_cache.is_cuda else contextlib.nullcontext()
        with on_gpu:  # a doorbell thread's current device is not necessarily the cache's
            dst = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
            src = torch.tensor(self.source_ids, dtype=torch.long, device=self.source.device)
            if fused_copy(self.source, kv_cache):  # one pass: copy, and checksum the words stored
                from kvrelay.kernels.triton_checksum import block_checksum

                self.landed = checksum_int(block_checksum(self.source, src, r.layer_start, r.layer_end, K1, K2,
                                                          dst=kv_cache, dst_ids=dst))
            else:  # peer to peer across GPUs, or on CPU (tests)
                moved = self.source[r.layer_start:r.layer_end].index_select(2, src).to(kv_cache.device)
                kv_cache[r.layer_start:r.layer_end].index_copy_(2, dst, moved)
                self.landed = device_checksum(kv_cache[r.layer_start:r.layer_end].index_select(2, dst))
        self.check(self.expected)


class CudaIpcExport:
    """Prefill side: answers offers with this worker's cache handle and turns chunks into block
    references with a device checksum."""

    def __init__(self, llm, node: str, metrics):
        self.llm, self.node, self.metrics = llm, node, metrics
        self._handle: kv_pb2.CudaIpcCache | None = None
        self._lock = threading.Lock()

    def answer(self, offer: kv_pb2.CudaIpcOffer) -> kv_pb2.CudaIpcCache | None:
        """The cache's handle if the offering decode worker can open it, else None (inline, counted)."""
        reason = self.refusal(offer)
        if reason is not None:
            self.metrics.plane_fallbacks.labels(PLANE, reason).inc()
            return None
        try:
            with self._lock:
                if self._handle is None:
                    self._handle = export_handle(self.llm.kv_cache)
        except RuntimeError as e:  # e.g. the allocator does not support IPC (expandable segments)
            log.warning("cannot export the KV cache over CUDA IPC (%s): K/V travels inline on gRPC", e)
            self.metrics.plane_fallbacks.labels(PLANE, "export_failed").inc()
            return None
        self.metrics.plane_handoffs.labels(PLANE).inc()
        return self._handle

    def refusal(self, offer: kv_pb2.CudaIpcOffer) -> str | None:
        """Why this worker cannot take the offer, or None."""
        if self.llm.kv_cache.device.type != "cuda":
            return "cpu_cache"
        if offer.node and self.node and offer.node != self.node:
            return "other_node"
        return None

    def chunk(self, header: kv_pb2.KVChunk, gathered: Payload, source_ids: list[int],
              checksum: int | None = None) -> kv_pb2.PrefillServerMessage:
        """The chunk message: the held blocks to copy and the checksum of their bytes (gathered:
        the chunk as gather_blocks packs it; checksum: already computed on the GPU's copy stream)."""
        if checksum is None:
            if not isinstance(gathered, torch.Tensor):  # a CPU cache's block views (tests drive the plane on CPU)
                gathered = torch.from_numpy(np.concatenate([a.reshape(-1) for a in payload_arrays(gathered)]))
            checksum = device_checksum(gathered)
        header.source_block_ids.extend(source_ids)
        header.device_checksum = checksum
        return kv_pb2.PrefillServerMessage(chunk=header)


# Caches exported by this process, by nonce: CUDA refuses to open a process's own IPC handle, so a
# decode worker in the same process (the GPU device script) takes the tensor itself.
_EXPORTED: dict[bytes, torch.Tensor] = {}


def export_handle(kv_cache: torch.Tensor) -> kv_pb2.CudaIpcCache:
    """The cache's CUDA IPC handle, as torch.multiprocessing shares a CUDA tensor."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, (_, shape, stride, tensor_offset, _, _, device, handle, size_bytes, offset_bytes, _, ref_handle, ref_offset,
        event_handle, event_sync) = reduce_tensor(kv_cache)
    nonce = secrets.token_bytes(16)
    _EXPORTED[nonce] = kv_cache
    return kv_pb2.CudaIpcCache(
        device_index=device, handle=handle, storage_size_bytes=size_bytes, storage_offset_bytes=offset_bytes,
        ref_counter_handle=ref_handle, ref_counter_offset=ref_offset, event_handle=event_handle or b"",
        event_sync_required=event_sync, shape=list(shape), stride=list(stride), tensor_offset=tensor_offset,
        nonce=nonce)


def open_handle(msg: kv_pb2.CudaIpcCache, dtype: torch.dtype) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    local = _EXPORTED.get(msg.nonce)
    if local is not None:
        return local
    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(msg.shape), tuple(msg.stride), msg.tensor_offset, torch.storage.UntypedStorage,
        dtype, msg.device_index, msg.handle, msg.storage_size_bytes, msg.storage_offset_bytes, False,
        msg.ref_counter_handle, msg.ref_counter_offset, msg.event_handle or None, msg.event_sync_required)


class CudaIpcSources:
    """Decode side: which prefill workers are offered the plane, and their opened caches."""

    def __init__(self, layout: KVLayout, device: torch.device, node: str, metrics, opener=open_handle):
        self.layout, self.device, self.node, self.metrics = layout, device, node, metrics
        self._opener = opener
        self._caches: dict[bytes, torch.Tensor] = {}  # by CudaIpcCache.nonce
        self._refused: set[str] = set()  # prefill addresses whose handle did not open
        self._lock = threading.Lock()  # the event loop and doorbell threads open handles

    def offer(self, prefill_addr: str) -> kv_pb2.CudaIpcOffer | None:
        if prefill_addr in self._refused:
            return None
        return kv_pb2.CudaIpcOffer(node=self.node, device_index=self.device.index or 0)

    def open(self, prefill_addr: str, msg: kv_pb2.CudaIpcCache) -> torch.Tensor:
        """The prefill worker's cache; ChunkError (and no further offers to it) when it cannot be
        opened or does not hold this layout."""
        with self._lock:
            return self._open(prefill_addr, msg)

    def _open(self, prefill_addr: str, msg: kv_pb2.CudaIpcCache) -> torch.Tensor:
        cache = self._caches.get(msg.nonce)
        if cache is not None:
            return cache
        lay = self.layout
        want = (lay.num_layers, 2, lay.block_size, lay.num_kv_heads, lay.head_dim)
        shape = tuple(msg.shape)
        try:
            if len(shape) != 6 or shape[:2] + shape[3:] != want:
                raise ValueError(f"cache shape {shape} is not [{lay.num_layers}, 2, blocks, {lay.block_size}, "
                                 f"{lay.num_kv_heads}, {lay.head_dim}]")
            cache = self._opener(msg, lay.torch_dtype)
        except (RuntimeError, ValueError, TypeError) as e:
            self._refused.add(prefill_addr)
            self.metrics.plane_fallbacks.labels(PLANE, "open_failed").inc()
            raise ChunkError(f"cannot open the CUDA IPC handle of {prefill_addr}'s KV cache ({e}); further "
                             f"hand-offs from it go inline on gRPC") from None
        self._caches[msg.nonce] = cache
        return cache

    def accept(self, verifier: ChunkVerifier, chunk: kv_pb2.KVChunk, source: torch.Tensor) -> IpcChunk:
        if not chunk.source_block_ids:
            raise ChunkError("a KV chunk on the CUDA IPC plane names no source blocks")
        d = verifier.accept_direct(chunk, source)
        c = IpcChunk(d.range, source, d.source_ids)
        c.expected = chunk.device_checksum
        return c

    def close(self) -> None:
        self._caches.clear()
