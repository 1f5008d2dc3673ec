"""Sliding-window attention and soft-capping in every attention kernel: the torch reference
against a dense computation, and the native C and Triton (interpreted) kernels against the
reference. Table entries of blocks wholly before the window point at a poisoned block, as they
may after the scheduler freed those blocks: a kernel that reads them is visibly wrong."""

from __future__ import annotations

import random

import pytest
import torch
from kernel_cases import DTYPES, assert_close, make_paged_case, randn
from kvrelay.kernels import cpu_native, reference
from kvrelay.kernels.triton_decode_attention import paged_decode_attention as triton_decode
from kvrelay.kernels.triton_prefill_attention import paged_prefill_attention as triton_prefill


def _case(contexts, chunks, window, block_size, num_kv_heads, group, head_dim, dtype, seed):
    rng = random.Random(seed)
    case = make_paged_case(rng, contexts, block_size, num_kv_heads, head_dim, dtype)
    poison = int(case.block_tables[0, -1])  # make_paged_case's poisoned block
    for b, (ctx, chunk) in enumerate(zip(contexts, chunks)):
        first_visible = max(0, ctx - chunk - window + 1)
        case.block_tables[b, : first_visible // block_size] = poison
    q = randn((sum(chunks), num_kv_heads * group, head_dim), dtype, seed + 1)
    starts = torch.tensor([0, *torch.tensor(chunks).cumsum(0).tolist()], dtype=torch.int32)
    return case, q, starts


def _dense(q, case, contexts, chunks, window, softcap, scale, block_size):
    """Each query row against its visible keys, one row at a time, in fp64."""
    k_cache, v_cache = case.layer()
    out, row = torch.empty(q.shape, dtype=torch.float64), 0
    for b, (ctx, chunk) in enumerate(zip(contexts, chunks)):
        slots = [int(case.block_tables[b, p // block_size]) * block_size + p % block_size for p in range(ctx)]
        for i in range(chunk):
            pos = ctx - chunk + i
            keys = [p for p in range(ctx) if pos - window < p <= pos]
            k = k_cache.flatten(0, 1)[[slots[p] for p in keys]].double()  # [n, Hkv, D]
            v = v_cache.flatten(0, 1)[[slots[p] for p in keys]].double()
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            s = torch.einsum("hd,nhd->hn", q[row].double(), k) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            out[row] = torch.einsum("hn,nhd->hd", s.softmax(-1), v)
            row += 1
    return out


PREFILL_CASES = [  # contexts, chunks, window, block_size
    ([40, 70, 9], [40, 13, 1], 16, 8),
    ([100, 33], [30, 33], 5, 4),
    ([64, 50], [1, 50], 64, 16),  # window == context: full attention
]


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("contexts,chunks,window,block_size", PREFILL_CASES)
def test_reference_prefill_and_decode_match_a_dense_computation(contexts, chunks, window, block_size, softcap):
    case, q, qsl = _case(contexts, chunks, window, block_size, 2, 2, 16, torch.float32, seed=window)
    k_cache, v_cache = case.layer()
    scale = 0.7  # large scores, so soft-capping changes them
    want = _dense(q, case, contexts, chunks, window, softcap, scale, block_size).float()
    got = reference.paged_prefill_attention(q, k_cache, v_cache, case.block_tables, qsl, case.seq_lens, scale,
                                            window=window, softcap=softcap)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    decode_rows = [int(qsl[b + 1]) - 1 for b in range(len(contexts))]  # each sequence's last query row
    got = reference.paged_decode_attention(q[decode_rows], k_cache, v_cache, case.block_tables, case.seq_lens,
                                           scale, window=window, softcap=softcap)
    torch.testing.assert_close(got, want[decode_rows], atol=1e-5, rtol=1e-5)


def test_window_and_softcap_change_the_result():
    contexts, chunks = [60], [1]
    case, q, _ = _case(contexts, chunks, 8, 4, 1, 2, 16, torch.float32, seed=3)
    k_cache, v_cache = case.layer()
    full = reference.paged_decode_attention(q, k_cache, v_cache, case.block_tables, case.seq_lens, 0.7)
    windowed = reference.paged_decode_attention(q, k_cache, v_cache, case.block_tables, case.seq_lens, 0.7,
                                                window=8)
    capped = reference.paged_decode_attention(q, k_cache, v_cache, case.block_tables, case.seq_lens, 0.7,
                                              window=8, softcap=1.0)
    assert not torch.allclose(full, windowed) and not torch.allclose(windowed, capped)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_triton_decode_window_and_softcap(softcap, dtype, num_splits):
    contexts = [1, 20, 77, 200]
    case, q, _ = _case(contexts, [1] * 4, 24, 16, 2, 4, 64, dtype, seed=7)
    k_cache, v_cache = case.layer()
    kw = {"window": 24, "softcap": softcap}
    got = triton_decode(q, k_cache, v_cache, case.block_tables, case.seq_lens, 0.3, num_splits=num_splits, **kw)
    want = reference.paged_decode_attention(q, k_cache, v_cache, case.block_tables, case.seq_lens, 0.3, **kw)
    assert_close(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("window", [5, 20, 33])
def test_triton_prefill_window_and_softcap(window, softcap, dtype):
    # Small tiles: windows narrower than, equal-ish to and wider than a tile; chunks after a prefix.
    contexts, chunks = [70, 45, 16, 1], [70, 13, 16, 1]
    case, q, qsl = _case(contexts, chunks, window, 8, 2, 2, 64, dtype, seed=window)
    k_cache, v_cache = case.layer()
    kw = {"window": window, "softcap": softcap}
    got = triton_prefill(q, k_cache, v_cache, case.block_tables, qsl, case.seq_lens, 0.3, block_m=16, block_n=16,
                         **kw)
    want = reference.paged_prefill_attention(q, k_cache, v_cache, case.block_tables, qsl, case.seq_lens, 0.3, **kw)
    assert_close(got, want)


@pytest.mark.skipif(cpu_native.unavailable_reason() is not None, reason="no native kernels here")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("window", [1, 7, 16, 300])
def test_native_decode_window_and_softcap(window, softcap, dtype):
    contexts = [1, 20, 77, 200, 16]
    case, q, _ = _case(contexts, [1] * 5, window, 8, 2, 4, 64, dtype, seed=window)
    k_cache, v_cache = case.layer()
    assert cpu_native.supports_decode(q, k_cache, v_cache)
    got = cpu_native.paged_decode_attention(q, k_cache, v_cache, case.block_tables, case.seq_lens, 0.3,
                                            window, softcap)
    want = reference.paged_decode_attention(q, k_cache, v_cache, case.block_tables, case.seq_lens, 0.3,
                                            window=window, softcap=softcap)
    assert_close(got, want)


def test_gemma2_engine_on_triton_matches_transformers(tmp_path):
    """Soft-capping, GeGLU and a 16-token window on one layer, end to end through the Triton kernels."""
    import shutil

    import transformers
    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.engine.llm_engine import LLMEngine
    from kvrelay.engine.sampling_params import SamplingParams

    from kvrelay.models import BUNDLED_MODEL

    config = transformers.Gemma2Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
        max_position_embeddings=256, initializer_range=1.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(BUNDLED_MODEL / name, tmp_path / name)
    engine = LLMEngine(EngineArgs(model=str(tmp_path), kernel_backend="triton", device="cpu", num_kv_blocks=32,
                                  max_num_batched_tokens=16))
    prompt = "The little bird flew over the big tree and saw a cat who was very hungry and sad. The cat said"
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12), "a")
    got = []
    while engine.has_work():
        for out in engine.step():
            got += out.new_token_ids
    ids = engine.tokenizer.encode_prompt(prompt)
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert len(ids) > 2 * 16  # the window slides
    assert got == want[0, len(ids):].tolist()
