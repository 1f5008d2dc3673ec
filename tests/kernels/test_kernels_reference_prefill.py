"""The torch reference's prefill attention (query tiles against the keys each tile can see) against
a plain fp64 masked softmax: more rows than one tile, chunks continuing a cached prefix, GQA."""

from __future__ import annotations

import random

import pytest
import torch
from kernel_cases import assert_close, make_paged_case, randn
from kvrelay.kernels import reference


def naive(q, k, v, scale):
    """q[Lq, Hq, D] at the last Lq positions of k, v[ctx, Hkv, D]; fp64, whole masked square."""
    lq, hq, _ = q.shape
    ctx, hkv, _ = k.shape
    k = k.double().repeat_interleave(hq // hkv, dim=1)
    v = v.double().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    future = torch.arange(ctx)[None, :] > torch.arange(ctx - lq, ctx)[:, None]
    scores.masked_fill_(future, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 3])
def test_tiles_prefix_chunks_and_gqa_match_fp64(group, dtype):
    # Contexts and new-token counts: a fresh prompt over three tiles, a chunk continuing a long
    # prefix, one token after a prefix, and a chunk ending exactly on a tile boundary.
    contexts, chunks = [300, 410, 57, 2 * reference.PREFILL_TILE], [300, 150, 1, reference.PREFILL_TILE]
    case = make_paged_case(random.Random(group), contexts, 16, 2, 32, dtype)
    k_cache, v_cache = case.layer()
    q = randn((sum(chunks), 2 * group, 32), dtype, 7)
    qsl = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32)
    got = reference.paged_prefill_attention(q, k_cache, v_cache, case.block_tables, qsl, case.seq_lens, 0.2)
    for b, ctx in enumerate(contexts):
        blocks = case.block_tables[b, : -(-ctx // 16)].long()
        k = k_cache[blocks].flatten(0, 1)[:ctx]
        v = v_cache[blocks].flatten(0, 1)[:ctx]
        want = naive(q[qsl[b] : qsl[b + 1]], k, v, 0.2).to(dtype)
        assert_close(got[qsl[b] : qsl[b + 1]], want)
