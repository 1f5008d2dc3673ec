"""RMSNorm, fused add + RMSNorm, rotary embedding and SiLU-and-mul (Triton, interpreted) vs torch."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DTYPES, assert_close, randn
from kvrelay.engine.model_config import ModelConfig, rope_cos_sin_cache
from kvrelay.kernels import reference
from kvrelay.kernels.triton_activation import silu_and_mul
from kvrelay.kernels.triton_norm import fused_add_rms_norm, rms_norm
from kvrelay.kernels.triton_rotary import rotary_embedding


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 8), (5, 64), (3, 4, 100), (2, 1000)])
def test_rms_norm(shape, dtype):
    x = randn(shape, dtype, 0) * 3
    w = randn(shape[-1:], dtype, 1)
    assert_close(rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))


def test_rms_norm_fp32_weight_promotes_like_torch():
    x = randn((4, 32), torch.bfloat16, 0)
    w = randn((32,), torch.float32, 1)
    assert_close(rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), dtype=torch.bfloat16)


def test_rms_norm_on_non_contiguous_heads():
    # The engine normalises q/k views cut out of the fused qkv projection (qk-norm).
    qkv = randn((6, 3 * 4 * 16), torch.float32, 0)
    q = qkv[:, : 4 * 16].reshape(6, 4, 16)
    w = randn((16,), torch.float32, 1)
    assert_close(rms_norm(q, w, 1e-6), reference.rms_norm(q, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 8), (7, 64), (3, 300)])
def test_fused_add_rms_norm(shape, dtype):
    x, res, w = randn(shape, dtype, 0), randn(shape, dtype, 1), randn(shape[-1:], dtype, 2)
    out, summed = fused_add_rms_norm(x, res, w, 1e-6)
    want_out, want_summed = reference.fused_add_rms_norm(x, res, w, 1e-6)
    assert_close(summed, want_summed)
    assert_close(out, want_out)
    assert torch.equal(x, randn(shape, dtype, 0)), "inputs must not be modified"


def rope_config(head_dim: int, rope_type: str, params: dict) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=1,
        num_heads=4, num_kv_heads=2, head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=10000.0,
        rope_type=rope_type, rope_params=params, max_position_embeddings=64, tie_word_embeddings=False,
        qkv_bias=False, qk_norm=False, sliding_window=None, torch_dtype=None,
    )


ROPE_VARIANTS = [
    ("default", {}),
    ("linear", {"factor": 4.0}),
    ("llama3", {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16}),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [8, 64, 128])
@pytest.mark.parametrize("rope_type,params", ROPE_VARIANTS, ids=[v[0] for v in ROPE_VARIANTS])
def test_rotary_embedding(rope_type, params, head_dim, dtype):
    num_tokens, num_heads, num_kv_heads = 9, 4, 2
    cache = rope_cos_sin_cache(rope_config(head_dim, rope_type, params), 256)
    # q and k as the engine passes them: strided views into one fused qkv projection.
    qkv = randn((num_tokens, (num_heads + 2 * num_kv_heads) * head_dim), dtype, 0)
    q = qkv[:, : num_heads * head_dim].reshape(num_tokens, num_heads, head_dim)
    k_cols = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    k = k_cols.reshape(num_tokens, num_kv_heads, head_dim)
    positions = torch.tensor([0, 1, 2, 17, 64, 100, 200, 254, 255])
    got_q, got_k = rotary_embedding(positions, q, k, cache)
    want_q, want_k = reference.rotary_embedding(positions, q, k, cache)
    assert_close(got_q, want_q)
    assert_close(got_k, want_k)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 16), (5, 344), (2, 3, 2 * 1500)])
def test_silu_and_mul(shape, dtype):
    x = randn(shape, dtype, 0) * 4
    assert_close(silu_and_mul(x), reference.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_tanh_and_mul(dtype):
    from kvrelay.kernels.triton_activation import gelu_tanh_and_mul

    x = randn((7, 2 * 96), dtype, 5) * 4  # large gates saturate the tanh at both ends
    assert_close(gelu_tanh_and_mul(x), reference.gelu_tanh_and_mul(x))
