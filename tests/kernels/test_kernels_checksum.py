"""The CUDA IPC plane's checksum in one Triton pass (interpreted): the torch version's number bit for bit."""

from __future__ import annotations

import pytest
import torch
from kvrelay.kernels.triton_checksum import BLOCK, checksum
from kvrelay.kvtransfer.cuda_ipc import K1, K2, torch_checksum


@pytest.mark.parametrize("num_words", [0, 1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5])
def test_triton_checksum_is_thetorch_checksum(num_words):
    g = torch.Generator().manual_seed(num_words)
    words = torch.randint(-(2**31), 2**31, (num_words,), dtype=torch.int64, generator=g).to(torch.int32)
    got = checksum(words, K1, K2)
    assert got.dtype == torch.int64 and got.shape == ()
    assert int(got) == int(torch_checksum(words))


def test_triton_checksum_sees_a_flipped_bit_and_moved_words():
    words = torch.arange(1, 2 * BLOCK + 3, dtype=torch.int32) * 2654435761 % (2**31)
    base = int(checksum(words, K1, K2))
    flipped = words.clone()
    flipped[BLOCK + 1] ^= 1 << 30
    swapped = words.clone()
    swapped[[0, 2 * BLOCK]] = swapped[[2 * BLOCK, 0]]
    assert int(checksum(flipped, K1, K2)) != base and int(checksum(swapped, K1, K2)) != base


def _cache(num_blocks: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, 2, num_blocks, 4, 2, 8, generator=g).to(dtype)  # [L, 2, blocks, bs, H, D]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layers,ids", [((0, 3), [4, 1, 7]), ((1, 2), [2]), ((0, 2), [])],
                         ids=["all_layers", "one_layer_one_block", "no_blocks"])
def test_block_checksum_is_the_checksum_of_the_gathered_blocks(dtype, layers, ids):
    from kvrelay.kernels import reference
    from kvrelay.kernels.triton_checksum import block_checksum

    cache = _cache(9, dtype)
    src_ids = torch.tensor(ids, dtype=torch.long)
    packed = reference.gather_blocks(cache, src_ids, *layers).contiguous().reshape(-1).view(torch.uint8)
    want = int(torch_checksum(packed.view(torch.int32)))
    assert int(block_checksum(cache, src_ids, *layers, K1, K2)) == want


def test_block_checksum_copies_into_the_destination_blocks_and_sums_what_it_stored():
    """The decode side's one pass: the blocks land where dst_ids say, nothing else is written,
    and the number is the gathered source's; a source block changed before the copy changes it."""
    from kvrelay.kernels import reference
    from kvrelay.kernels.triton_checksum import block_checksum

    src, dst = _cache(9), _cache(6, seed=1)
    before = dst.clone()
    src_ids, dst_ids = torch.tensor([4, 1, 7]), torch.tensor([5, 0, 2])
    want = int(block_checksum(src, src_ids, 1, 3, K1, K2))
    assert int(block_checksum(src, src_ids, 1, 3, K1, K2, dst=dst, dst_ids=dst_ids)) == want
    assert torch.equal(dst[1:3, :, dst_ids], src[1:3, :, src_ids])
    untouched = before.clone()
    untouched[1:3, :, dst_ids] = dst[1:3, :, dst_ids]
    assert torch.equal(dst, untouched)  # layer 0 and the other blocks as they were
    landed = reference.gather_blocks(dst, dst_ids, 1, 3).contiguous().reshape(-1).view(torch.uint8)
    assert int(torch_checksum(landed.view(torch.int32))) == want
    src[2, 1, 7, 3, 1, 5] += 1.0
    assert int(block_checksum(src, src_ids, 1, 3, K1, K2, dst=dst, dst_ids=dst_ids)) != want


def test_ipc_chunk_copies_in_one_pass_where_the_kernel_can(monkeypatch):
    """IpcChunk.copy_into on one GPU takes block_checksum's copy (here interpreted, the device test
    forced on CPU tensors): the blocks land, layers outside the range stay, and a checksum that
    differs from what landed is caught."""
    from kvrelay.kvtransfer import cuda_ipc
    from kvrelay.kvtransfer.errors import ChunkError
    from kvrelay.kvtransfer.layout import ChunkRange

    calls = []
    monkeypatch.setattr(cuda_ipc, "fused_copy", lambda source, cache: calls.append(1) or True)
    source, dest = _cache(9, seed=2), torch.zeros(3, 2, 6, 4, 2, 8, dtype=torch.bfloat16)
    held, reserved = [7, 2, 5], [0, 4, 3]
    expected = cuda_ipc.device_checksum(source[1:3].index_select(2, torch.tensor(held)))
    chunk = cuda_ipc.IpcChunk(ChunkRange(1, 3, 0, 3), source, held)
    chunk.expected = expected
    chunk.copy_into(dest, reserved)
    assert calls and chunk.landed == expected
    assert torch.equal(dest[1:3, :, reserved], source[1:3, :, held]) and not dest[0].any()
    bad = cuda_ipc.IpcChunk(ChunkRange(1, 3, 0, 3), source, held)
    bad.expected = expected ^ 1
    with pytest.raises(ChunkError, match="checksum mismatch"):
        bad.copy_into(dest, reserved)


def test_block_checksum_of_blocks_longer_than_one_program():
    """A block of 2 * BLOCK + 64 words takes three programs per row; their partials add up."""
    from kvrelay.kernels import reference
    from kvrelay.kernels.triton_checksum import block_checksum, block_words

    g = torch.Generator().manual_seed(5)
    cache = torch.randn(2, 2, 3, 2 * BLOCK + 64, generator=g)  # float32: a word per element
    assert block_words(cache) == 2 * BLOCK + 64
    ids = torch.tensor([2, 0])
    packed = reference.gather_blocks(cache, ids, 0, 2).contiguous().reshape(-1).view(torch.int32)
    assert int(block_checksum(cache, ids, 0, 2, K1, K2)) == int(torch_checksum(packed))
    assert block_words(cache[:, :, :, 1:]) is None  # not contiguous: the callers gather instead
