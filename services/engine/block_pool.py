"""Paged KV block pool: reference counts, hash-keyed prefix cache, LRU eviction.

Every block is either in use (ref_count > 0) or on the free queue. A free block may still
hold a cached prefix (it keeps its hash); it is evicted, least recently freed first, only
when a fresh block is needed. A cache hit on a free block takes it back off the queue.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids) -> int:
    """Stable 64-bit key of a full block, chained from its parent's key.

    Stable across processes and machines, so routers can compute the same keys from a prompt.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(parent_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


def cache_root(salt: str | None, lora: str | None = None) -> int:
    """The parent key of a prompt's first block. A salt (the tenant's cache group and the request's
    `cache_salt`) gives its requests a prefix cache of their own: other salts neither hit nor time it.
    A LoRA adapter's K/V differ from the base model's: its name salts the key too."""
    if lora:
        salt = f"{salt or ''}\x00lora:{lora}"
    if not salt:
        return ROOT_HASH
    return int.from_bytes(hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def prompt_block_hashes(token_ids: list[int], block_size: int, root: int = ROOT_HASH) -> list[int]:
    """Keys of every full block of token_ids, in order (chained from `root`, see cache_root)."""
    hashes, parent = [], root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.queries = 0  # tokens looked up in the prefix cache
        self.hits = 0  # tokens found

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_queue):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block, _ = self.free_queue.popitem(last=False)
            self._evict(block)
            self.ref_count[block] = 1
            out.append(block)
        return out

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            if self.cached.get(h) == block:
                del self.cached[h]

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block. Tail blocks go first to the queue, so they are
        evicted before the shared prefix blocks that precede them."""
        for block in reversed(blocks):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free_queue[block] = None
            elif self.ref_count[block] < 0:
                raise AssertionError(f"block {block} freed twice")

    def lookup(self, hashes: list[int], num_tokens_queried: int, block_size: int) -> list[int]:
        """Take a reference on the longest cached run of `hashes`; returns those blocks."""
        found = []
        if self.enable_prefix_caching:
            for h in hashes:
                block = self.cached.get(h)
                if block is None:
                    break
                found.append(block)
            for block in found:
                if self.ref_count[block] == 0:
                    del self.free_queue[block]
                self.ref_count[block] += 1
        self.queries += num_tokens_queried
        self.hits += len(found) * block_size
        return found

    def register(self, block: int, block_hash: int) -> None:
        """Mark a full, computed block as holding the prefix keyed by block_hash."""
        if not self.enable_prefix_caching or self.block_hash[block] is not None:
            return
        if block_hash not in self.cached:
            self.cached[block_hash] = block
            self.block_hash[block] = block_hash

    def cached_hashes(self) -> list[int]:
        return list(self.cached)

    def reset_prefix_cache(self) -> None:
        for block in range(self.num_blocks):
            self._evict(block)
