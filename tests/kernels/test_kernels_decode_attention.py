"""Paged decode attention (Triton, interpreted) against the torch reference."""

from __future__ import annotations

import random

import pytest
import torch
from kernel_cases import DTYPES, assert_close, make_paged_case, randn
from kvrelay.kernels import reference
from kvrelay.kernels.triton_decode_attention import choose_num_splits, paged_decode_attention


def run_case(seq_lens, block_size, num_kv_heads, group, head_dim, dtype, seed, num_splits=None):
    rng = random.Random(seed)
    case = make_paged_case(rng, seq_lens, block_size, num_kv_heads, head_dim, dtype)
    q = randn((len(seq_lens), num_kv_heads * group, head_dim), dtype, seed + 1)
    k_cache, v_cache = case.layer()
    scale = head_dim**-0.5
    tables, lens = case.block_tables, case.seq_lens
    got = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, num_splits=num_splits)
    want = reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    assert_close(got, want)
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_gqa_ratios_head_dims_dtypes(group, head_dim, dtype):
    # Length 1, an exact multiple of the block size, and ragged lengths in one batch.
    run_case([1, 32, 45], block_size=16, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype,
             seed=group)


@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_kv_matches_reference(num_splits, dtype):
    # More splits than some sequences have tokens: empty splits must not disturb the combination.
    run_case([1, 16, 200, 77], block_size=16, num_kv_heads=2, group=4, head_dim=64, dtype=dtype,
             seed=num_splits, num_splits=num_splits)


def test_split_and_single_pass_agree():
    single = run_case([300, 5], 16, 1, 8, 64, torch.float32, seed=3, num_splits=1)
    split = run_case([300, 5], 16, 1, 8, 64, torch.float32, seed=3, num_splits=5)
    torch.testing.assert_close(single, split, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("group", [1, 2])
def test_small_head_dim_uses_broadcast_path(group, dtype):
    # stories260K: head_dim 8, 8 query heads over 4 KV heads.
    run_case([1, 9, 16, 40], block_size=16, num_kv_heads=4, group=group, head_dim=8, dtype=dtype, seed=11)


@pytest.mark.parametrize("seed", range(6))
def test_randomised_shapes(seed):
    rng = random.Random(1000 + seed)
    block_size = rng.choice([4, 8, 16, 32])
    lens = [rng.randint(1, 150) for _ in range(rng.randint(1, 5))]
    group = rng.choice([1, 2, 4, 8])
    head_dim = rng.choice([8, 16, 32, 64, 80, 128])
    dtype = rng.choice(DTYPES)
    splits = rng.choice([None, 1, 2, 4])
    run_case(lens, block_size, rng.randint(1, 2), group, head_dim, dtype, seed, num_splits=splits)


def test_num_splits_heuristic():
    cpu = torch.device("cpu")
    assert choose_num_splits(64, 8, 8192, cpu) == 1  # plenty of programs already
    assert choose_num_splits(1, 1, 8192, cpu) > 1  # one long sequence is split
    assert choose_num_splits(1, 1, 100, cpu) == 1  # too short to be worth it


def test_lengths_beyond_the_block_table_are_clamped_to_it():
    # A bad seq_lens must not send the kernel past the table (on a GPU: a memory fault).
    rng = random.Random(7)
    case = make_paged_case(rng, [32, 20], 16, 2, 64, torch.float32, extra_width=0)
    q = randn((2, 4, 64), torch.float32, 1)
    k_cache, v_cache = case.layer()
    too_long = torch.tensor([32 + 50, 20], dtype=torch.int32)
    got = paged_decode_attention(q, k_cache, v_cache, case.block_tables, too_long, 0.125, num_splits=2)
    want = reference.paged_decode_attention(q, k_cache, v_cache, case.block_tables, case.seq_lens, 0.125)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_reference_buckets_agree_with_one_padded_pass(monkeypatch):
    """The torch path splits big batches into length-sorted buckets; the split must not change
    the result (here forced: a 1 KiB bucket budget gives ceil(20 / 8) = 3 buckets)."""
    rng = random.Random(5)
    lens = [rng.randint(1, 90) for _ in range(20)]
    case = make_paged_case(rng, lens, 16, 2, 64, torch.float32)
    q = randn((20, 4, 64), torch.float32, 6)
    k_cache, v_cache = case.layer()
    one = reference.paged_decode_attention(q, k_cache, v_cache, case.block_tables, case.seq_lens, 0.125)
    monkeypatch.setattr(reference, "DECODE_BUCKET_BYTES", 1024)
    split = reference.paged_decode_attention(q, k_cache, v_cache, case.block_tables, case.seq_lens, 0.125)
    assert torch.allclose(one, split, atol=1e-6, rtol=0)
    calls = []
    monkeypatch.setattr(reference, "_decode_attention_padded", lambda q, *a: calls.append(len(q)) or q)
    reference.paged_decode_attention(q, k_cache, v_cache, case.block_tables, case.seq_lens, 0.125)
    assert sorted(calls) == [6, 7, 7]
