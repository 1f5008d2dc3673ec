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
