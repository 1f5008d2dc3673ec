"""The CUDA IPC plane's K/V checksum (kvrelay.kvtransfer.cuda_ipc.device_checksum) in one pass.

The checksum is sum over a buffer's 32-bit words of word * w(i) mod 2**64, with an odd weight
w(i) = ((i * K1) ^ ((i * K2) >> 29)) | 1 mixed from the word's index. In torch it takes ~8 passes
over int64 temporaries eight times the buffer's size (a 67 MB chunk moves ~1 GB); here each
program reads its words once, computes the weights in registers and writes one int64 partial sum,
and torch adds the partials. All arithmetic is int64 and wraps (two's complement), so the result
is the torch version's bit for bit, whatever the order of the additions.

block_checksum computes the same number for a chunk of a KV cache's blocks straight from the
cache, in gather_blocks' packing order, without packing them: the prefill side no longer gathers a
CUDA IPC chunk at all, and the decode side copies the blocks into its reservation in the same pass,
checksumming the words it stores (what landed), where it made three passes before.
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


@triton.jit
def _block_checksum_kernel(src_ptr, src_ids_ptr, dst_ptr, dst_ids_ptr, partial_ptr, layer_start, num_ids,
                           src_blocks, dst_blocks, block_words, k1, k2, COPY: tl.constexpr, BLOCK: tl.constexpr):
    # Row r of the packed chunk [layers, 2, num_ids, block_words] is (plane = layer * 2 + k/v, id j).
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1).to(tl.int64)
    plane = layer_start * 2 + row // num_ids
    j = row % num_ids
    w = part * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = w < block_words
    src_block = tl.load(src_ids_ptr + j).to(tl.int64)
    words = tl.load(src_ptr + (plane * src_blocks + src_block) * block_words + w, mask=mask, other=0)
    if COPY:
        dst_block = tl.load(dst_ids_ptr + j).to(tl.int64)
        tl.store(dst_ptr + (plane * dst_blocks + dst_block) * block_words + w, words, mask=mask)
    idx = row * block_words + w  # the word's index in the packed chunk
    weight = ((idx * k1) ^ ((idx * k2) >> 29)) | 1
    total = tl.sum((words.to(tl.int64) & 0xFFFFFFFF) * weight, axis=0)
    tl.store(partial_ptr + row * tl.num_programs(1) + part, total)


def block_words(cache: torch.Tensor) -> int | None:
    """32-bit words per block of a contiguous cache [layers, 2, blocks, ...]; None when
    block_checksum cannot read it (not contiguous, or a block's bytes not a multiple of 4)."""
    nbytes = cache[0, 0, 0].numel() * cache.element_size()
    return nbytes // 4 if cache.is_contiguous() and nbytes % 4 == 0 else None


def block_checksum(src: torch.Tensor, src_ids: torch.Tensor, layer_start: int, layer_end: int, k1: int, k2: int,
                   dst: torch.Tensor | None = None, dst_ids: torch.Tensor | None = None) -> torch.Tensor:
    """checksum() of gather_blocks(src, src_ids, layer_start, layer_end) without packing it. Given
    dst and dst_ids (a cache of src's shape but its number of blocks), also copies those blocks of
    src into dst's blocks dst_ids in the same pass: the number is then that of what landed. Both
    caches on one device and readable per block_words; ids are int64 on it. Returns an int64
    scalar, without waiting for the device."""
    words = block_words(src)
    assert words is not None and (dst is None or block_words(dst) == words), "see block_words"
    n = src_ids.numel()
    rows = (layer_end - layer_start) * 2 * n
    parts = triton.cdiv(words, BLOCK)
    partial = torch.zeros(max(rows * parts, 1), dtype=torch.int64, device=src.device)
    if rows:
        copy = dst is not None
        out = dst if copy else src
        _block_checksum_kernel[(rows, parts)](
            src.reshape(-1).view(torch.int32), src_ids, out.reshape(-1).view(torch.int32),
            dst_ids if copy else src_ids, partial, layer_start, n, src.shape[2], out.shape[2], words, k1, k2,
            COPY=copy, BLOCK=BLOCK)
    return partial.sum()
