"""Block pool: reference counts, chained prefix hashes, LRU eviction of unreferenced cached blocks."""

from __future__ import annotations

import subprocess
import sys

import pytest
from kvrelay.engine.block_pool import BlockPool, NoFreeBlocksError, hash_block, prompt_block_hashes


def test_hashes_chain_on_the_parent():
    a = prompt_block_hashes(list(range(32)), 16)
    b = prompt_block_hashes(list(range(16)) + [99] + list(range(17, 32)), 16)
    c = prompt_block_hashes([0] * 16 + list(range(16, 32)), 16)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert a[1] != c[1]  # same tokens in block 2, different parent
    assert prompt_block_hashes(list(range(31)), 16) == a[:1]  # partial blocks are not keyed


def test_hashes_are_stable_across_processes():
    code = "from kvrelay.engine.block_pool import hash_block; print(hash_block(0, [1, 2, 3]))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123"},
    )
    assert int(out.stdout) == hash_block(0, [1, 2, 3])


def test_refcounts_and_exhaustion():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert pool.num_free == 1
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    pool.free(blocks)
    assert pool.num_free == 4
    with pytest.raises(AssertionError):
        pool.free(blocks[:1])


def test_cached_block_hit_takes_a_reference_and_leaves_the_free_queue():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.register(b, 111)
    pool.free([b])
    assert pool.num_free == 4  # cached but unreferenced: counts as free
    assert pool.lookup([111, 222], num_tokens_queried=32, block_size=16) == [b]
    assert pool.ref_count[b] == 1 and pool.num_free == 3
    assert (pool.queries, pool.hits) == (32, 16)


def test_lru_eviction_takes_least_recently_freed_first():
    pool = BlockPool(3)
    x, y, z = pool.allocate(3)
    for blk, h in ((x, 1), (y, 2), (z, 3)):
        pool.register(blk, h)
    pool.free([x])
    pool.free([y])
    pool.free([z])
    (new,) = pool.allocate(1)  # evicts x, the least recently freed
    assert new == x and 1 not in pool.cached and pool.cached == {2: y, 3: z}
    assert pool.lookup([2], 16, 16) == [y]


def test_freeing_a_sequence_queues_its_tail_blocks_for_eviction_first():
    pool = BlockPool(3)
    seq = pool.allocate(3)
    for i, blk in enumerate(seq):
        pool.register(blk, 10 + i)
    pool.free(seq)
    assert pool.allocate(1) == [seq[2]]  # the prefix's head survives longest


def test_disabled_prefix_caching_never_hits():
    pool = BlockPool(2, enable_prefix_caching=False)
    (b,) = pool.allocate(1)
    pool.register(b, 5)
    pool.free([b])
    assert pool.lookup([5], 16, 16) == []


def test_hash_block_depends_on_every_token():
    assert hash_block(0, [1, 2]) != hash_block(0, [2, 1]) != hash_block(1, [1, 2])
