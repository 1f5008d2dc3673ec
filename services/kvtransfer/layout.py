"""What a KV buffer holds, how a request's K/V is cut into bounded chunks, and how each chunk is verified.

A chunk is the C-contiguous tensor [layers, 2 (K, V), blocks, block_size, kv_heads, head_dim]
of one layer range x one block range of a request, as `ops.gather_blocks` packs it. Every chunk
carries the full layout and an XXH3-64 checksum; the receiver checks both, the ranges and the size before a
byte reaches its cache, and checks at the end that every (layer, block) arrived exactly once.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from kvrelay.kernels import native_ops
from kvrelay.kvtransfer.chunk_wire import block_pieces, checksum, pieces_checksum
from kvrelay.kvtransfer.errors import ChunkError, LayoutMismatchError
from kvrelay.v1 import kv_pb2

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
# Bytes a chunk message may carry besides its payload (layout strings, ranges, framing).
MESSAGE_OVERHEAD = 4096
DEFAULT_MAX_MESSAGE_BYTES = 4 * 2**20


@dataclass(frozen=True)
class KVLayout:
    model_id: str
    model_revision: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def bytes_per_block_layer(self) -> int:
        """Bytes of K and V of one block in one layer."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.torch_dtype.itemsize

    def bytes_for_blocks(self, num_blocks: int) -> int:
        """Bytes of K and V of num_blocks blocks in every layer: a whole prompt's hand-off."""
        return num_blocks * self.num_layers * self.bytes_per_block_layer

    def to_proto(self) -> kv_pb2.KVLayout:
        return kv_pb2.KVLayout(**asdict(self))

    @classmethod
    def from_proto(cls, msg: kv_pb2.KVLayout) -> KVLayout:
        return cls(**{f: getattr(msg, f) for f in cls.__dataclass_fields__})

    @classmethod
    def of_engine(cls, llm, revision: str | None = None) -> KVLayout:
        """The layout of an LLMEngine's paged cache."""
        cfg = llm.config
        return cls(
            model_id=llm.model_name,
            model_revision=revision or model_revision(llm.args),
            dtype=DTYPE_NAMES[llm.dtype],
            block_size=llm.args.block_size,
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
        )

    def describe(self) -> str:
        return (f"{self.model_id}@{self.model_revision} {self.dtype} block_size={self.block_size} "
                f"layers={self.num_layers} kv_heads={self.num_kv_heads} head_dim={self.head_dim}")


def check_layout(expected: KVLayout, got: KVLayout, where: str) -> None:
    """Raise LayoutMismatchError naming every differing field."""
    diffs = [f"{f}: expected {getattr(expected, f)!r}, got {getattr(got, f)!r}"
             for f in KVLayout.__dataclass_fields__ if getattr(expected, f) != getattr(got, f)]
    if diffs:
        raise LayoutMismatchError(
            f"KV layout mismatch ({where}): " + "; ".join(diffs)
            + ". Prefill and decode workers must serve the same model revision with the same --dtype "
              "and --block-size."
        )


def model_revision(args) -> str:
    """A fingerprint of the weights a worker serves: config, load format, and the safetensors
    files' headers, sizes and first/last MiB. Cheap for any model size; pass --model-revision
    (e.g. a git or hub commit) to pin it explicitly."""
    h = hashlib.blake2b(digest_size=8)
    model_dir = Path(args.model)
    h.update((model_dir / "config.json").read_bytes())
    h.update(json.dumps([args.load_format, args.dummy_seed if args.load_format == "dummy" else None,
                         args.quantization]).encode())
    if args.load_format != "dummy":
        for path in sorted(model_dir.glob("*.safetensors")):
            size = path.stat().st_size
            h.update(f"{path.name}:{size}".encode())
            with path.open("rb") as f:
                h.update(f.read(2**20))
                f.seek(max(0, size - 2**20))
                h.update(f.read(2**20))
    return h.hexdigest()


@dataclass(frozen=True)
class ChunkRange:
    layer_start: int
    layer_end: int
    block_start: int
    block_end: int


def plan_chunks(layout: KVLayout, layer_start: int, layer_end: int, num_blocks: int,
                max_message_bytes: int, block_start: int = 0) -> list[ChunkRange]:
    """Cut layers [layer_start, layer_end) x blocks [block_start, num_blocks) into chunks whose
    payload fits one message."""
    per = layout.bytes_per_block_layer
    budget = max_message_bytes - MESSAGE_OVERHEAD
    if per > budget:
        raise ValueError(
            f"max message size {max_message_bytes} B cannot carry one block of one layer ({per} B plus "
            f"{MESSAGE_OVERHEAD} B framing): raise --max-message-bytes")
    layers = layer_end - layer_start
    if layers * per <= budget:  # whole layer range, as many blocks as fit
        step = budget // (layers * per)
        return [ChunkRange(layer_start, layer_end, b, min(b + step, num_blocks))
                for b in range(block_start, num_blocks, step)]
    layers_per = budget // per  # fewer layers, one block range each
    out = []
    for lo in range(layer_start, layer_end, layers_per):
        hi = min(lo + layers_per, layer_end)
        step = budget // ((hi - lo) * per)
        out.extend(ChunkRange(lo, hi, b, min(b + step, num_blocks)) for b in range(block_start, num_blocks, step))
    return out


def chunk_header(layout_msg: kv_pb2.KVLayout, r: ChunkRange, num_tokens: int) -> kv_pb2.KVChunk:
    """Every KVChunk field but the payload and its checksum (chunk_wire.encode_chunk_message adds them)."""
    return kv_pb2.KVChunk(layout=layout_msg, layer_start=r.layer_start, layer_end=r.layer_end,
                          block_start=r.block_start, block_end=r.block_end, num_tokens=num_tokens)


@dataclass(frozen=True)
class ReceivedChunk:
    """A chunk whose layout, range and size passed ChunkVerifier.accept. Its bytes are reached
    only through checked_tensor(), which checks the checksum first: the decode worker calls it on
    the engine thread right before the copy into its blocks, so the bytes come from memory once
    (the checksum's pass) and the copy reads them from cache, with no thread hop in between."""

    range: ChunkRange
    data: object  # bytes-like
    xxh3_64: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    def checked_tensor(self) -> torch.Tensor:
        digest = checksum(self.data)
        if digest != self.xxh3_64:
            raise ChunkError(f"KV chunk checksum mismatch (xxh3_64 {digest:#018x}, sent {self.xxh3_64:#018x}): "
                             f"corrupted in transit")
        with warnings.catch_warnings():  # read-only buffer: scatter only reads it
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(self.data, dtype=torch.uint8).view(self.dtype).reshape(self.shape)


@dataclass(eq=False)
class DirectChunk:
    """A direct chunk that passed ChunkVerifier.accept_direct: its bytes are blocks source_ids of
    the prefill worker's cache. copy_into copies them into the receiver's blocks and hashes what
    landed there; check compares that with the prefill worker's hash, which follows in a later
    frame (the prefill worker hashes while this side copies). Only the copied bytes prove
    anything: the source is another process's memory, which could change under the copy (its
    lease expired). The blocks are the request's reservation, unused until the hand-off
    completes, so a chunk that fails the check leaves nothing behind: the hand-off fails and the
    reservation is freed."""

    range: ChunkRange
    source: torch.Tensor
    source_ids: list[int]
    landed: int | None = None  # XXH3-64 of the bytes copy_into wrote
    awaits_checksum = True  # the doorbell matches it with a checksum from a later frame

    def copy_into(self, kv_cache: torch.Tensor, block_ids: list[int]) -> None:
        r = self.range
        native_ops.copy_blocks(kv_cache, torch.tensor(block_ids), self.source, torch.tensor(self.source_ids),
                               r.layer_start, r.layer_end)
        self.landed = pieces_checksum(block_pieces(kv_cache.view(torch.uint8).numpy(), block_ids, r.layer_start,
                                                   r.layer_end))

    def check(self, xxh3_64: int) -> None:
        if self.landed != xxh3_64:
            got = "nothing copied" if self.landed is None else f"xxh3_64 {self.landed:#018x}"
            raise ChunkError(f"KV chunk checksum mismatch after the direct copy ({got}, sent {xxh3_64:#018x}): "
                             f"the prefill worker's blocks changed under the copy")


class ChunkVerifier:
    """Receiver side of one hand-off: verifies each chunk against the expected layout and
    request size, tracks which (layer, block) slices arrived, and proves completeness.

    first_block: the leading blocks the receiver already holds (its prefix cache); chunks must
    cover exactly blocks [first_block, num_blocks) of every layer."""

    def __init__(self, layout: KVLayout, num_tokens: int, num_blocks: int, first_block: int = 0):
        self.layout = layout
        self.num_tokens = num_tokens
        self.num_blocks = num_blocks
        self.first_block = first_block
        self.seen = np.zeros((layout.num_layers, num_blocks), dtype=bool)
        self.seen[:, :first_block] = True  # never sent (accept refuses chunks there): present already
        self.bytes = 0

    def verify(self, chunk: kv_pb2.KVChunk, payload=None) -> tuple[ChunkRange, torch.Tensor]:
        """accept() and the checksum at once: the checked (range, tensor)."""
        received = self.accept(chunk, payload)
        return received.range, received.checked_tensor()

    def accept(self, chunk: kv_pb2.KVChunk, payload=None) -> ReceivedChunk:
        """Check a chunk's layout, range, size and overlap, whose data is `payload` (a bytes-like
        view, from chunk_wire) or else chunk.data; raises LayoutMismatchError or ChunkError. Its
        checksum is checked by ReceivedChunk.checked_tensor, the only way to its bytes."""
        lay = self.layout
        r = self._check_range(chunk)
        shape = (r.layer_end - r.layer_start, 2, r.block_end - r.block_start, lay.block_size,
                 lay.num_kv_heads, lay.head_dim)
        want = int(np.prod(shape)) * lay.torch_dtype.itemsize
        data = chunk.data if payload is None else payload  # chunk.data copies on each access: read once
        if len(data) != want:
            raise ChunkError(f"KV chunk carries {len(data)} bytes, its shape {shape} needs {want}")
        self._mark(r, want)
        return ReceivedChunk(r, data, chunk.xxh3_64, shape, lay.torch_dtype)

    def accept_direct(self, chunk: kv_pb2.KVChunk, source: torch.Tensor) -> DirectChunk:
        """accept() for a chunk of the direct hand-off, whose bytes are the blocks
        chunk.source_block_ids of source (the prefill worker's cache, read-only). Its checksum
        comes later (DoorbellFrame.checksums) and is checked by DirectChunk.check, on what landed
        in the receiver's blocks."""
        r = self._check_range(chunk)
        if chunk.data or chunk.shm_size:
            raise ChunkError("a direct KV chunk must not carry bytes inline or in the region")
        ids = list(chunk.source_block_ids)
        if len(ids) != r.block_end - r.block_start or not all(0 <= b < source.shape[2] for b in ids):
            raise ChunkError(f"direct KV chunk names {len(ids)} source blocks for {r.block_end - r.block_start} "
                             f"blocks, or one outside the prefill worker's {source.shape[2]}")
        size = (r.layer_end - r.layer_start) * len(ids) * self.layout.bytes_per_block_layer
        self._mark(r, size)
        return DirectChunk(r, source, ids)

    def _check_range(self, chunk: kv_pb2.KVChunk) -> ChunkRange:
        lay = self.layout
        check_layout(lay, KVLayout.from_proto(chunk.layout), "KV chunk")
        r = ChunkRange(chunk.layer_start, chunk.layer_end, chunk.block_start, chunk.block_end)
        if not (0 <= r.layer_start < r.layer_end <= lay.num_layers
                and self.first_block <= r.block_start < r.block_end <= self.num_blocks):
            raise ChunkError(f"KV chunk range layers [{r.layer_start}, {r.layer_end}) blocks [{r.block_start}, "
                             f"{r.block_end}) is outside {lay.num_layers} layers x blocks [{self.first_block}, "
                             f"{self.num_blocks}) expected")
        if chunk.num_tokens != self.num_tokens:
            raise ChunkError(f"KV chunk describes {chunk.num_tokens} tokens, the request has {self.num_tokens}")
        return r

    def _mark(self, r: ChunkRange, size: int) -> None:
        window = self.seen[r.layer_start:r.layer_end, r.block_start:r.block_end]
        if window.any():
            raise ChunkError(f"KV chunk layers [{r.layer_start}, {r.layer_end}) blocks [{r.block_start}, "
                             f"{r.block_end}) overlaps a slice already received")
        window[:] = True
        self.bytes += size

    def check_complete(self) -> None:
        missing = int((~self.seen).sum())
        if missing:
            raise ChunkError(f"KV transfer incomplete: {missing} of {self.seen.size} (layer, block) slices "
                             f"never arrived")
