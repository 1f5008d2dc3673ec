"""The CUDA IPC plane's K/V checksum (kvrelay.kvtransfer.cuda_ipc.device_checksum) in one pass.

The checksum is sum over a buffer's 32-bit words of word * w(i) mod 2**64, with an odd weight
w(i) = ((i * K1) ^ ((i * K2) >> 29)) | 1 mixed from the word's index. In torch it takes ~8 passes
over int64 temporaries eight times the buffer's size (a 67 MB chunk moves ~1 GB); here each
program reads its words once, computes the weights in registers and writes one int64 partial sum,
and torch adds the partials. All arithmetic is int64 and wraps (two's complement), so the result
is the torch version's bit for bit, whatever the order of the additions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # words per program: a 16 KiB read


@triton.jit
def _checksum_kernel(words_ptr, partial_ptr, num_words, k1, k2, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = idx < num_words
    w = tl.load(words_ptr + idx, mask=mask, other=0).to(tl.int64) & 0xFFFFFFFF
    weight = ((idx * k1) ^ ((idx * k2) >> 29)) | 1  # >> on int64 is arithmetic, as torch's
    tl.store(partial_ptr + pid, tl.sum(w * weight, axis=0))  # masked words load as 0


def checksum(words: torch.Tensor, k1: int, k2: int) -> torch.Tensor:
    """words: a contiguous 1-D int32 tensor (a buffer's bytes viewed as 32-bit words); k1, k2: the
    weight constants as int64 values. Returns the checksum as an int64 scalar on words' device,
    without waiting for the device."""
    n = words.numel()
    programs = max(triton.cdiv(n, BLOCK), 1)
    partial = torch.empty(programs, dtype=torch.int64, device=words.device)
    _checksum_kernel[(programs,)](words, partial, n, k1, k2, BLOCK=BLOCK)
    return partial.sum()
