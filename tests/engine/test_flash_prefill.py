"""Prefill of chunks without a cached prefix through KernelOps.fresh_prefill_attention (FlashAttention
varlen on CUDA): which steps may take it, that the model hands it the right rows, and on CUDA that
it equals the paged kernels' reference."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F
from helpers import PROMPTS, greedy, make_engine, run_engine
from kvrelay.kernels import flash_prefill, reference
from kvrelay.kernels.registry import get_ops

from kvrelay.models import BUNDLED_MODEL


def _sdpa_fresh(q, k, v, query_start_loc, max_query_len, scale, *, window=None, softcap=None):
    """The fresh-prefill contract computed by torch SDPA, chunk by chunk (a CPU stand-in for
    FlashAttention with the same inputs)."""
    if window is not None or softcap is not None:
        return None
    bounds = query_start_loc.tolist()
    assert max_query_len == max(b - a for a, b in itertools.pairwise(bounds))
    out = []
    for a, b in itertools.pairwise(bounds):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
        out.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
                   .transpose(0, 1))
    return torch.cat(out)


def _record_batches(engine) -> list:
    seen, forward = [], engine.model.forward

    def recording(batch, kv_cache):
        seen.append(batch.prefill_fresh_max_len)
        return forward(batch, kv_cache)

    engine.model.forward = recording
    return seen


def test_fresh_prompts_mark_their_longest_chunk_and_prefixes_clear_it():
    engine = make_engine(BUNDLED_MODEL, device="cpu", max_num_batched_tokens=2048)
    seen = _record_batches(engine)
    ids = [engine.tokenizer.encode(p) for p in PROMPTS[:3]]
    run_engine(engine, {f"r{i}": (p, greedy(3)) for i, p in enumerate(PROMPTS[:3])})
    assert seen[0] == max(len(i) for i in ids)  # the step that prefills all three prompts
    assert seen[1:] == [0, 0]  # decode-only steps
    # The longest prompt (over a block) again hits the prefix cache: its chunk starts past position 0.
    seen.clear()
    run_engine(engine, {"again": (PROMPTS[2], greedy(2))})
    assert seen[0] == 0


def test_a_chunk_after_the_first_has_a_prefix():
    engine = make_engine(BUNDLED_MODEL, device="cpu", max_num_batched_tokens=16, enable_prefix_caching=False)
    seen = _record_batches(engine)
    long_prompt = " ".join(PROMPTS)
    run_engine(engine, {"long": (long_prompt, greedy(2))})
    assert seen[0] == 16 and seen[1] == 0


def test_the_model_hands_the_fast_path_each_chunk_and_keeps_the_tokens():
    plain = make_engine(BUNDLED_MODEL, device="cpu")
    fast = make_engine(BUNDLED_MODEL, device="cpu")
    calls = []

    def counting(*args, **kw):
        calls.append(args[4])
        return _sdpa_fresh(*args, **kw)

    fast.model.ops = dataclasses.replace(fast.model.ops, fresh_prefill_attention=counting)
    requests = {f"r{i}": (p, greedy(12)) for i, p in enumerate(PROMPTS)}
    assert run_engine(fast, requests) == run_engine(plain, requests)
    assert calls and len(calls) % fast.config.num_layers == 0  # every layer of the prefill steps


def test_no_fast_path_off_cuda_or_without_a_backend_for_it():
    q = torch.randn(8, 4, 64, dtype=torch.bfloat16)
    k = v = torch.randn(8, 2, 64, dtype=torch.bfloat16)
    qsl = torch.tensor([0, 3, 8], dtype=torch.int32)
    assert flash_prefill.fresh_prefill_attention(q, k, v, qsl, 5, 0.125) is None
    assert get_ops("torch").fresh_prefill_attention is None
    assert flash_prefill.available() == (torch.cuda.is_available() and flash_prefill._varlen() is not None)


cuda = pytest.mark.skipif(not flash_prefill.available(), reason="needs CUDA and torch.nn.attention.varlen")


def _paged(k, v, block_size=16):
    """The packed chunks' K/V laid out in a paged cache, one run of blocks per chunk."""
    return k.view(-1, block_size, *k.shape[1:]), v.view(-1, block_size, *v.shape[1:])


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [None, 48])
def test_flash_equals_the_paged_reference(dtype, head_dim, window):  # pragma: no cover - CUDA only
    dev, bs, heads, kv_heads = "cuda", 16, 8, 2
    lengths = [1, 37, 300, 16, 700]
    padded = [-(-n // bs) * bs for n in lengths]  # each chunk starts on a block boundary
    gen = torch.Generator(device="cpu").manual_seed(head_dim)
    total = sum(padded)
    k_all = torch.randn(total, kv_heads, head_dim, generator=gen).to(dev, dtype)
    v_all = torch.randn(total, kv_heads, head_dim, generator=gen).to(dev, dtype)
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip([0, *torch.tensor(padded).cumsum(0)[:-1].tolist()],
                                                            lengths)]).to(dev)
    q = torch.randn(sum(lengths), heads, head_dim, generator=gen).to(dev, dtype)
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    qsl = torch.tensor(starts, dtype=torch.int32, device=dev)
    k_cache, v_cache = _paged(k_all, v_all, bs)
    first_block = [0, *torch.tensor(padded).cumsum(0)[:-1].tolist()]
    width = max(padded) // bs
    tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    for b, (s, p) in enumerate(zip(first_block, padded)):
        tables[b, : p // bs] = torch.arange(s // bs, (s + p) // bs)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=dev)
    scale = head_dim**-0.5
    want = reference.paged_prefill_attention(q, k_cache, v_cache, tables.to(dev), qsl, seq_lens, scale, window=window)
    got = flash_prefill.fresh_prefill_attention(q, k_all[rows], v_all[rows], qsl, max(lengths), scale, window=window)
    assert got is not None and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@cuda
def test_flash_declines_what_it_cannot_serve():  # pragma: no cover - CUDA only
    qsl = torch.tensor([0, 8], dtype=torch.int32, device="cuda")
    q32 = torch.randn(8, 4, 64, device="cuda")
    assert flash_prefill.fresh_prefill_attention(q32, q32[:, :2], q32[:, :2], qsl, 8, 0.125) is None
    q16 = q32.half()
    assert flash_prefill.fresh_prefill_attention(q16, q16[:, :2], q16[:, :2], qsl, 8, 0.125, softcap=30.0) is None
    assert get_ops("triton").fresh_prefill_attention is flash_prefill.fresh_prefill_attention


@cuda
def test_bf16_engine_takes_the_flash_path_on_cuda():  # pragma: no cover - CUDA only
    engine = make_engine(BUNDLED_MODEL, device="cuda", dtype="bfloat16", kv_cache_memory=64 * 2**20)
    served = []
    flash = engine.model.ops.fresh_prefill_attention
    assert flash is not None

    def counting(*args, **kw):
        out = flash(*args, **kw)
        served.append(out is not None)
        return out

    engine.model.ops = dataclasses.replace(engine.model.ops, fresh_prefill_attention=counting)
    out = run_engine(engine, {f"r{i}": (p, greedy(8)) for i, p in enumerate(PROMPTS[:4])})
    assert served and all(served)  # every layer of the prefill step, none declined
    assert all(len(ids) == 8 for ids in out.values())
