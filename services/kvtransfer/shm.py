"""Shared-memory data plane for a prefill and a decode worker on the same node.

The decode worker owns an arena: one file on a shared-memory mount (/dev/shm, or a memory-backed
emptyDir/hostPath both pods mount), mapped once for its lifetime. For each hand-off it carves a
region big enough for the prompt's whole K/V out of the arena and offers it in PrefillStart. A
prefill worker that can open the same file (checked by the nonce the file begins with) writes
each chunk's bytes there and sends only the chunk's header and checksum on the gRPC stream;
otherwise the bytes go inline as before. The control stream, verification, leases and aborts
are the same either way: only where the payload travels changes.

An arena's file lives as long as its decode worker: the worker holds an exclusive flock(2) on it,
which the kernel drops when the process dies however it dies, and every new arena first deletes
files in its directory whose lock is free (their owner was killed before it could unlink them),
so a crash-looping decode worker on a hostPath cannot fill the node's memory with dead arenas.

Cost per byte: one copy in (prefill: cache blocks -> region), one checksum each side, one copy
out (decode: region -> reserved blocks). No socket, no kernel copies, no page faults after the
arena's first use.

Direct hand-off (prefill worker with --kv-shared-cache): the prefill worker's whole KV cache lives
in an arena file of its own (SharedKVCache), and a decode worker on the same node maps it
read-only (SourceCaches) and copies the held blocks straight into its reserved ones: one copy
instead of two, and still only the decode worker writes into its cache.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import secrets
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from kvrelay.kvtransfer.layout import KVLayout
from kvrelay.v1 import kv_pb2

log = logging.getLogger(__name__)

NONCE_BYTES = 16
PREFIX = "kvrelay-kv-"  # arena files
CREATING_PREFIX = ".creating-kvrelay-kv-"  # an arena until it is locked and sized
# A file still under its creating name this long after its last change lost its creator (killed
# mid-creation); younger ones may be between their creation and their lock, microseconds apart.
CREATING_GRACE_S = 60.0
DATA_START = 4096  # the nonce lives in the first page; regions start after it
ALIGN = 4096  # regions start on page boundaries
DOORBELL_SUFFIX = ".sock"  # the arena's doorbell socket: the arena's path plus this
# Page tables filled at map time: no page fault per 4 KiB on a region's first use in each process.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


@dataclass(frozen=True)
class Region:
    offset: int  # from the start of the arena file
    size: int


class ShmArena:
    """Decode side: the arena file, its mapping, and a first-fit allocator of regions."""

    def __init__(self, size: int, directory: str | Path = "/dev/shm"):
        if size <= DATA_START:
            raise ValueError(f"shared-memory arena of {size} B is too small: it needs more than {DATA_START} B")
        self.size = size
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        file = None
        try:
            # Every page now: a sparse file on a full tmpfs would SIGBUS on first touch.
            file = LockedFile(directory, lambda fd: os.posix_fallocate(fd, 0, size))
            self._map = mmap.mmap(file.fd, size, flags=_MAP_FLAGS)
        except OSError as e:
            if file is not None:
                file.close()
            raise OSError(f"cannot reserve a {size} B shared-memory arena in {directory}: {e.strerror}; lower "
                          f"--kv-shm-bytes or mount a bigger memory-backed directory (--kv-shm-dir)") from e
        self.file, self.path, self.removed_stale = file, file.path, file.removed_stale
        self._map[:NONCE_BYTES] = self.nonce
        self.view = np.frombuffer(self._map, dtype=np.uint8)
        self._free: list[tuple[int, int]] = [(DATA_START, size - DATA_START)]  # (offset, size), sorted
        self._lock = threading.Lock()

    @property
    def free_bytes(self) -> int:
        return sum(n for _, n in self._free)

    @property
    def capacity(self) -> int:
        return self.size - DATA_START

    def allocate(self, nbytes: int) -> Region | None:
        """A region of at least nbytes, or None when no free run is big enough (send inline then)."""
        need = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            for i, (off, n) in enumerate(self._free):
                if n >= need:
                    if n == need:
                        del self._free[i]
                    else:
                        self._free[i] = (off + need, n - need)
                    return Region(off, need)
        return None

    def free(self, region: Region) -> None:
        with self._lock:
            self._free.append((region.offset, region.size))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for off, n in self._free:
                if merged and merged[-1][0] + merged[-1][1] == off:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((off, n))
            self._free = merged

    def close(self) -> None:
        """Unlink the file; mappings (ours, a prefill worker's) stay valid until unmapped."""
        self.file.close()


class LockedFile:
    """A new file PREFIX + pid + random in directory whose descriptor (fd) holds an exclusive flock
    until close() or the process's death; after that remove_stale_arenas deletes it and its doorbell
    socket. Creating one first sweeps the files of workers that are gone (removed_stale). It is
    created under another name and locked before it gets this one, so a sweep never sees it
    unlocked; prepare(fd), if given, runs before the rename. An arena's file; alone (empty), the
    anchor of the CUDA IPC plane's doorbell socket, which has no arena beside it."""

    def __init__(self, directory: str | Path = "/dev/shm", prepare=None):
        self.removed_stale = remove_stale_arenas(directory)
        name = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        path, creating = Path(directory) / f"{PREFIX}{name}", Path(directory) / f"{CREATING_PREFIX}{name}"
        fd = os.open(creating, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if prepare is not None:
                prepare(fd)
            os.rename(creating, path)
        except OSError:
            os.close(fd)
            creating.unlink(missing_ok=True)
            raise
        self.path, self.fd = path, fd

    def close(self) -> None:
        self.path.unlink(missing_ok=True)
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def doorbell_path(beside: Path) -> Path:
    """The doorbell socket of an arena or LockedFile: its path plus DOORBELL_SUFFIX."""
    return beside.with_name(beside.name + DOORBELL_SUFFIX)


def remove_stale_arenas(directory: str | Path) -> list[Path]:
    """Delete arena files in directory that no live process holds (their decode worker was
    killed); returns them. A live arena's owner holds an exclusive flock on it, which this
    probe cannot take."""
    removed = []
    directory = Path(directory)
    creating = [p for p in directory.glob(f"{CREATING_PREFIX}*") if _age_s(p) > CREATING_GRACE_S]
    for sock in directory.glob(f"{PREFIX}*{DOORBELL_SUFFIX}"):
        # A doorbell (kvrelay.kvtransfer.doorbell) is bound after its arena has its name and
        # unlinked before it: one without its arena lost its decode worker.
        if not sock.with_name(sock.name.removesuffix(DOORBELL_SUFFIX)).exists():
            sock.unlink(missing_ok=True)
            removed.append(sock)
    arenas = [p for p in directory.glob(f"{PREFIX}*") if not p.name.endswith(DOORBELL_SUFFIX)]
    for path in sorted(arenas) + creating:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile, or not ours to read
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # locked: its decode worker is alive
        else:
            # Unlinked while we hold the lock: an owner cannot have appeared in between (a new
            # arena is locked before it gets its name).
            path.unlink(missing_ok=True)
            removed.append(path)
            doorbell = doorbell_path(path)
            if doorbell.exists():
                doorbell.unlink(missing_ok=True)
                removed.append(doorbell)
            log.warning("removed shared-memory arena %s left by a decode worker that is gone", path)
        finally:
            os.close(fd)
    return removed


def _age_s(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0


def map_file(path: str, writable: bool) -> mmap.mmap:
    """The whole file, mapped shared (raises OSError, or ValueError for an empty file)."""
    fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
    try:
        return mmap.mmap(fd, 0, flags=_MAP_FLAGS, prot=mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0))
    finally:
        os.close(fd)


def has_nonce(m: mmap.mmap, nonce: bytes) -> bool:
    """Whether the mapped file begins with nonce: the file its owner named, not another."""
    return len(nonce) == NONCE_BYTES and m[:NONCE_BYTES] == nonce


def forget_gone(maps: dict[str, object]) -> None:
    """Drop mappings of files that are gone (their owner stopped), so that their pages can be
    freed once nothing still reads or writes them."""
    for path in [p for p in maps if not os.path.exists(p)]:
        del maps[path]


class ShmOpener:
    """Prefill side: maps offered arena files once each and hands out views of their regions."""

    def __init__(self):
        self._maps: dict[str, tuple[mmap.mmap, np.ndarray]] = {}

    def open(self, path: str, nonce: bytes, offset: int, size: int) -> np.ndarray | None:
        """A writable uint8 view of the region, or None when this worker cannot see that file
        (another node, another mount) or the offer does not fit it: the bytes then go inline."""
        entry = self._maps.get(path)
        if entry is None:
            forget_gone(self._maps)
            try:
                m = map_file(path, writable=True)
            except (OSError, ValueError):
                return None
            entry = self._maps[path] = (m, np.frombuffer(m, dtype=np.uint8))
        m, view = entry
        if not has_nonce(m, nonce):
            # A file of that name exists but is not the decode worker's arena (or was replaced).
            del self._maps[path]
            return None
        if offset < DATA_START or offset + size > len(m):
            return None
        return view[offset:offset + size]

    def close(self) -> None:
        self._maps.clear()  # the mmaps unmap when the last view of them goes


class SharedKVCache:
    """Prefill side: LLMEngine's kv_cache_storage for a cache in an arena file (DATA_START on),
    which decode workers on the same node may map read-only (the direct hand-off)."""

    def __init__(self, directory: str | Path = "/dev/shm"):
        self.directory = directory
        self.arena: ShmArena | None = None

    def __call__(self, nbytes: int) -> torch.Tensor:
        """nbytes of zeroed, committed shared memory (fallocate, MAP_POPULATE) as a uint8 tensor."""
        self.arena = ShmArena(DATA_START + nbytes, self.directory)
        return torch.from_numpy(self.arena.view[DATA_START:])

    def offer(self) -> kv_pb2.ShmRegion:
        """The cache file: path, nonce, and where the cache lies in it."""
        return kv_pb2.ShmRegion(path=str(self.arena.path), nonce=self.arena.nonce, offset=DATA_START,
                                size=self.arena.size - DATA_START)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()


class SourceCaches:
    """Decode side: prefill workers' shared KV caches, mapped read-only once each, as tensors
    [L, 2, num_blocks, block_size, kv_heads, head_dim] of the decode worker's own layout."""

    def __init__(self, layout: KVLayout):
        self._block = (layout.block_size, layout.num_kv_heads, layout.head_dim)
        self._layers = layout.num_layers
        self._dtype = layout.torch_dtype
        self._maps: dict[str, tuple[mmap.mmap, torch.Tensor]] = {}
        self._lock = threading.Lock()  # doorbell reader threads, one per prefill worker

    def open(self, region: kv_pb2.ShmRegion) -> torch.Tensor:
        """The cache a kv_pb2.ShmRegion names; raises OSError when this worker cannot map it or
        the file is not (or no longer) that prefill worker's cache."""
        with self._lock:
            entry = self._maps.get(region.path)
            if entry is not None and not has_nonce(entry[0], region.nonce):
                del self._maps[region.path]  # replaced by another worker's file of that name
                entry = None
            if entry is None:
                entry = self._map(region)
                self._maps[region.path] = entry
            return entry[1]

    def prune(self) -> None:
        """Drop the mappings of caches whose file is gone (their prefill worker stopped), so the
        node gets their pages back once no copy still reads them."""
        with self._lock:
            forget_gone(self._maps)

    def _map(self, region: kv_pb2.ShmRegion) -> tuple[mmap.mmap, torch.Tensor]:
        m = map_file(region.path, writable=False)
        if not has_nonce(m, region.nonce):
            raise OSError(f"{region.path} is not the prefill worker's KV cache (nonce differs)")
        per_block = int(np.prod(self._block)) * self._dtype.itemsize * 2 * self._layers
        if region.offset != DATA_START or region.size % per_block or region.offset + region.size > len(m):
            raise OSError(f"{region.path}: {region.size} B at {region.offset} is not a KV cache of this layout "
                          f"({per_block} B per block) within its {len(m)} B")
        num_blocks = region.size // per_block
        raw = np.frombuffer(m, dtype=np.uint8, count=region.size, offset=region.offset)
        with warnings.catch_warnings():  # read-only: the copy only reads it
            warnings.simplefilter("ignore", UserWarning)
            cache = torch.frombuffer(raw, dtype=torch.uint8).view(self._dtype)
        return m, cache.view(self._layers, 2, num_blocks, *self._block)

    def close(self) -> None:
        with self._lock:
            self._maps.clear()
