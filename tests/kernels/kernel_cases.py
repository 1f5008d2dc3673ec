"""Inputs shared by the kernel tests: paged KV caches with scattered block tables, and tolerances."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The interpreter truncates fp32 -> bf16 (the GPU rounds to nearest), so bf16 gets a little extra room.
TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}
POISON = 100.0  # fills blocks no sequence owns: a kernel that reads them produces visibly wrong output


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    tol = TOLERANCES[dtype or expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), **tol)


@dataclass
class PagedCase:
    kv_cache: torch.Tensor  # [L, 2, num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor  # [B, width] int32
    seq_lens: torch.Tensor  # [B] int32

    def layer(self, index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_cache[index, 0], self.kv_cache[index, 1]


def make_paged_case(
    rng: random.Random,
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    num_layers: int = 1,
    spare_blocks: int = 3,
    extra_width: int = 2,
) -> PagedCase:
    """Each sequence gets its own blocks in a shuffled (non-contiguous) order; unused table entries and
    unowned blocks point at poisoned memory."""
    needed = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(needed) + spare_blocks + 1
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    poison_block = ids.pop()
    width = max(needed, default=0) + extra_width
    tables = []
    for n in needed:
        own, ids = ids[:n], ids[n:]
        tables.append(own + [poison_block] * (width - n))
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    kv = torch.randn((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), generator=gen).to(dtype)
    kv[:, :, poison_block] = POISON
    for spare in ids:
        kv[:, :, spare] = POISON
    # Tokens past each sequence's length inside its last block are poisoned too.
    for table, n in zip(tables, seq_lens):
        if n % block_size:
            kv[:, :, table[(n - 1) // block_size], n % block_size:] = POISON
    return PagedCase(
        kv_cache=kv,
        block_tables=torch.tensor(tables, dtype=torch.int32).reshape(len(seq_lens), width),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
    )


def randn(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
