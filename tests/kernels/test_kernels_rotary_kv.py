"""Rotary + KV write in one launch (Triton, interpreted): exactly rotary_embedding then write_kv."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DTYPES, randn
from kvrelay.kernels.triton_kv_cache import write_kv
from kvrelay.kernels.triton_rotary import rotary_embedding
from kvrelay.kernels.triton_rotary_kv import rotary_and_write_kv


def _inputs(num_tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    # Strided views of one fused QKV projection, as the model passes them.
    qkv = randn((num_tokens, (heads + 2 * kv_heads) * head_dim), dtype, 0)
    q = qkv[:, : heads * head_dim].reshape(num_tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(num_tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].reshape(num_tokens, kv_heads, head_dim)
    return q, k, v


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 8), (8, 2, 64), (6, 1, 128)])
def test_fused_rotary_and_kv_write_is_the_two_ops_bit_for_bit(heads, kv_heads, head_dim, dtype):
    q, k, v = _inputs(7, heads, kv_heads, head_dim, dtype)
    cos_sin = randn((300, head_dim), torch.float32, 3)
    positions = torch.tensor([0, 5, 299, 17, 64, 100, 1])
    slots = torch.tensor([5, -1, 17, 191, 33, 16 * 7 + 3, 40])  # -1: a padding row, written nowhere (not slot 0)
    cache = randn((2, 12, 16, kv_heads, head_dim), dtype, 4)
    before, want_cache = cache.clone(), cache.clone()
    got_q, got_k = rotary_and_write_kv(positions, q, k, v, cos_sin, cache[0], cache[1], slots)
    want_q, want_k = rotary_embedding(positions, q, k, cos_sin)
    write_kv(want_k, v, want_cache[0], want_cache[1], slots)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(cache, want_cache)
    assert not torch.equal(cache[0, 0, 5], before[0, 0, 5])  # slot 5 was written


def test_k_is_rounded_to_its_dtype_before_the_caches():
    q, k, v = _inputs(3, 4, 2, 16, torch.bfloat16)  # a cache wider than K: the rounding shows
    cos_sin = randn((8, 16), torch.float32, 3)
    positions, slots = torch.tensor([1, 2, 7]), torch.tensor([1, 9, 30])
    cache = torch.zeros((2, 4, 8, 2, 16), dtype=torch.float32)
    want_cache = cache.clone()
    rotary_and_write_kv(positions, q, k, v, cos_sin, cache[0], cache[1], slots)
    _, want_k = rotary_embedding(positions, q, k, cos_sin)
    write_kv(want_k, v, want_cache[0], want_cache[1], slots)
    assert torch.equal(cache, want_cache)


def test_refuses_a_table_of_another_head_dim():
    q, k, v = _inputs(2, 4, 2, 16, torch.float32)
    cache = torch.zeros((2, 4, 8, 2, 16))
    with pytest.raises(ValueError, match="expected head_dim 16"):
        rotary_and_write_kv(torch.tensor([0, 1]), q, k, v, torch.zeros((8, 8)), cache[0], cache[1],
                            torch.tensor([0, 1]))
