"""Paged prefill / extend attention (Triton, interpreted) against the torch reference."""

from __future__ import annotations

import random

import pytest
import torch
from kernel_cases import DTYPES, assert_close, make_paged_case, randn
from kvrelay.kernels import reference
from kvrelay.kernels.triton_prefill_attention import paged_prefill_attention


def run_case(
    contexts, chunks, block_size, num_kv_heads, group, head_dim, dtype, seed, block_m=None, block_n=None
):
    """contexts[b] tokens of context, the last chunks[b] of them new (queries of this step)."""
    rng = random.Random(seed)
    case = make_paged_case(rng, contexts, block_size, num_kv_heads, head_dim, dtype)
    starts = [0]
    for n in chunks:
        starts.append(starts[-1] + n)
    qsl = torch.tensor(starts, dtype=torch.int32)
    q = randn((starts[-1], num_kv_heads * group, head_dim), dtype, seed + 1)
    k_cache, v_cache = case.layer()
    scale = head_dim**-0.5
    got = paged_prefill_attention(q, k_cache, v_cache, case.block_tables, qsl, case.seq_lens, scale,
                                  block_m=block_m, block_n=block_n)
    tables, lens = case.block_tables, case.seq_lens
    want = reference.paged_prefill_attention(q, k_cache, v_cache, tables, qsl, lens, scale)
    assert_close(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_gqa_ratios_head_dims_dtypes(group, head_dim, dtype):
    # A whole prompt (no prefix), a chunk after a cached prefix, a one-token chunk.
    run_case([20, 45, 33], [20, 13, 1], block_size=16, num_kv_heads=1, group=group, head_dim=head_dim,
             dtype=dtype, seed=group)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tiles_cross_blocks_and_the_diagonal(dtype):
    # Small tiles: several query tiles per sequence, key tiles spanning blocks, lengths that are exact
    # multiples of the block size, and a sequence with an empty chunk.
    run_case([1, 64, 48, 70, 16], [1, 64, 0, 37, 16], block_size=16, num_kv_heads=2, group=2, head_dim=64,
             dtype=dtype, seed=5, block_m=16, block_n=16)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_small_head_dim_uses_broadcast_path(dtype):
    # stories260K: head_dim 8, 8 query heads over 4 KV heads.
    run_case([7, 40, 18], [7, 24, 1], block_size=16, num_kv_heads=4, group=2, head_dim=8, dtype=dtype, seed=9)


@pytest.mark.parametrize("seed", range(6))
def test_randomised_shapes(seed):
    rng = random.Random(2000 + seed)
    block_size = rng.choice([4, 8, 16, 32])
    num = rng.randint(1, 4)
    contexts = [rng.randint(1, 90) for _ in range(num)]
    chunks = [rng.randint(0 if c > 1 else 1, c) for c in contexts]
    head_dim = rng.choice([8, 16, 32, 64, 80, 128])
    tiles = rng.choice([(None, None), (16, 16), (32, 16), (16, 32)])
    run_case(contexts, chunks, block_size, rng.randint(1, 2), rng.choice([1, 2, 4, 8]), head_dim,
             rng.choice(DTYPES), seed, *tiles)


def test_whole_prompt_equals_sdpa():
    # Independent check of the reference itself on the simplest case: one causal prompt, no prefix.
    rng = random.Random(0)
    case = make_paged_case(rng, [24], 8, 2, 16, torch.float32)
    q = randn((24, 4, 16), torch.float32, 1)
    k_cache, v_cache = case.layer()
    qsl = torch.tensor([0, 24], dtype=torch.int32)
    got = paged_prefill_attention(q, k_cache, v_cache, case.block_tables, qsl, case.seq_lens, 0.25)
    blocks = case.block_tables[0, :3].long()
    k = k_cache[blocks].flatten(0, 1).repeat_interleave(2, dim=1).transpose(0, 1)
    v = v_cache[blocks].flatten(0, 1).repeat_interleave(2, dim=1).transpose(0, 1)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    want = sdpa(q.transpose(0, 1), k, v, is_causal=True, scale=0.25)
    torch.testing.assert_close(got, want.transpose(0, 1), atol=2e-5, rtol=2e-5)
