"""KV cache write and block gather/scatter (Triton, interpreted) vs torch: these must be exact."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DTYPES, randn
from kvrelay.kernels import reference
from kvrelay.kernels.triton_kv_cache import gather_blocks, scatter_blocks, write_kv


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_kv_heads,head_dim", [(4, 8), (2, 64), (1, 128)])
def test_write_kv_scatters_and_skips_padding(num_kv_heads, head_dim, dtype):
    kv = randn((2, 2, 12, 16, num_kv_heads, head_dim), dtype, 0)
    expected = kv.clone()
    # Non-contiguous key/value (views of a fused projection), scattered slots, a padding slot (-1).
    kvproj = randn((7, 2 * num_kv_heads * head_dim), dtype, 1)
    key = kvproj[:, : num_kv_heads * head_dim].view(7, num_kv_heads, head_dim)
    value = kvproj[:, num_kv_heads * head_dim :].view(7, num_kv_heads, head_dim)
    slots = torch.tensor([5, -1, 17, 191, 0, 16 * 7 + 3, 40])
    write_kv(key, value, kv[1, 0], kv[1, 1], slots)
    reference.write_kv(key, value, expected[1, 0], expected[1, 1], slots)
    assert torch.equal(kv, expected)


def test_write_kv_casts_to_cache_dtype():
    kv = torch.zeros((1, 2, 4, 8, 2, 16), dtype=torch.bfloat16)
    expected = kv.clone()
    key, value = randn((3, 2, 16), torch.float32, 0), randn((3, 2, 16), torch.float32, 1)
    slots = torch.tensor([1, 9, 30], dtype=torch.int32)
    write_kv(key, value, kv[0, 0], kv[0, 1], slots)
    reference.write_kv(key, value, expected[0, 0], expected[0, 1], slots)
    # The interpreter truncates fp32 -> bf16 where torch rounds: allow one bf16 ulp.
    torch.testing.assert_close(kv.float(), expected.float(), atol=0, rtol=2**-7)
    assert kv[0, 0, 1, 1].abs().sum() > 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layers", [(0, 3), (1, 2), (2, 3)])
def test_gather_then_scatter_moves_blocks(layers, dtype):
    start, end = layers
    src = randn((3, 2, 10, 4, 2, 8), dtype, 0)
    ids = torch.tensor([7, 2, 9, 3], dtype=torch.int32)
    packed = gather_blocks(src, ids, start, end)
    assert torch.equal(packed, reference.gather_blocks(src, ids, start, end))
    assert packed.is_contiguous() and packed.shape == (end - start, 2, 4, 4, 2, 8)

    dst = randn((3, 2, 10, 4, 2, 8), dtype, 1)
    expected = dst.clone()
    new_ids = torch.tensor([0, 5, 1, 8])
    scatter_blocks(dst, new_ids, packed, start, end)
    reference.scatter_blocks(expected, new_ids, packed, start, end)
    assert torch.equal(dst, expected)
    assert torch.equal(dst[start:end, :, new_ids], src[start:end, :, ids.long()])


def test_gather_large_block_uses_several_programs():
    # block_size * Hkv * D = 16 * 4 * 128 = 8192 elements: more than one copy tile per block.
    src = randn((1, 2, 3, 16, 4, 128), torch.float16, 0)
    ids = torch.tensor([2, 0])
    assert torch.equal(gather_blocks(src, ids, 0, 1), reference.gather_blocks(src, ids, 0, 1))


def test_gather_and_scatter_of_nothing():
    src = randn((2, 2, 4, 4, 1, 8), torch.float32, 0)
    before = src.clone()
    empty = torch.empty(0, dtype=torch.int32)
    assert gather_blocks(src, empty, 0, 2).shape == (2, 2, 0, 4, 1, 8)
    scatter_blocks(src, empty, torch.empty((2, 2, 0, 4, 1, 8)), 0, 2)
    assert torch.equal(src, before)


def test_scatter_rejects_a_mismatched_buffer():
    dst = torch.zeros((2, 2, 4, 4, 1, 8))
    with pytest.raises(ValueError, match="buffer shape"):
        scatter_blocks(dst, torch.tensor([0, 1]), torch.zeros((2, 2, 3, 4, 1, 8)), 0, 2)
