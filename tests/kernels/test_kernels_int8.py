"""int8 weight-only quantisation and matmul (Triton, interpreted) vs torch."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DTYPES, randn
from kvrelay.kernels import reference
from kvrelay.kernels.triton_int8 import int8_matmul, quantize_int8


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,k", [(1, 8), (48, 172), (33, 1500)])
def test_quantize_int8_matches_exactly(n, k, dtype):
    w = randn((n, k), dtype, 0)
    got_q, got_scale = quantize_int8(w)
    want_q, want_scale = reference.quantize_int8(w)
    assert got_q.dtype == torch.int8 and got_scale.dtype == torch.float32
    assert torch.equal(got_scale, want_scale)
    assert torch.equal(got_q, want_q)


def test_quantize_rounds_halves_to_even_and_handles_zero_rows():
    w = torch.zeros((2, 6))
    w[0] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -3.5])  # scale 1.0: exact halves
    q, scale = quantize_int8(w)
    want_q, want_scale = reference.quantize_int8(w)
    assert q[0].tolist() == [127, 0, 2, 2, 0, -4]
    assert torch.equal(q, want_q) and torch.equal(scale, want_scale)
    assert q[1].abs().sum() == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 17, 130])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_matmul(m, with_bias, dtype):
    n, k = 96, 172
    weight_q, scale = reference.quantize_int8(randn((n, k), torch.float32, 0))
    x = randn((m, k), dtype, 1)
    bias = randn((n,), dtype, 2) if with_bias else None
    got = int8_matmul(x, weight_q, scale, bias)
    want = reference.int8_matmul(x, weight_q, scale, bias)
    assert got.dtype == dtype
    tol = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol * 4, rtol=tol)


def test_int8_matmul_keeps_leading_dims():
    weight_q, scale = reference.quantize_int8(randn((40, 64), torch.float32, 0))
    x = randn((2, 3, 64), torch.float32, 1)
    got = int8_matmul(x, weight_q, scale)
    assert got.shape == (2, 3, 40)
    torch.testing.assert_close(got, reference.int8_matmul(x, weight_q, scale), atol=1e-4, rtol=1e-4)


def test_int8_matmul_rejects_wrong_in_features():
    weight_q, scale = reference.quantize_int8(randn((4, 16), torch.float32, 0))
    with pytest.raises(ValueError, match="input features"):
        int8_matmul(torch.zeros((2, 8)), weight_q, scale)


@pytest.mark.parametrize("split_k", [2, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_matmul_split_k_adds_up_the_same(split_k, with_bias):
    """Small-M products split K over programs (fp32 partial sums); bias is added once."""
    from kvrelay.kernels.triton_int8 import choose_split_k

    n, k = 40, 400
    weight_q, scale = reference.quantize_int8(randn((n, k), torch.float32, 0))
    x = randn((3, k), torch.bfloat16, 1)
    bias = randn((n,), torch.bfloat16, 2) if with_bias else None
    got = int8_matmul(x, weight_q, scale, bias, split_k=split_k)
    torch.testing.assert_close(got, int8_matmul(x, weight_q, scale, bias, split_k=1), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, reference.int8_matmul(x, weight_q, scale, bias), rtol=2e-2, atol=2e-2)
    # 132 SMs (an H200) and 64 tiles of a 4096-wide layer at M=1: split to about two programs per SM.
    assert choose_split_k(64, 4096, 128, torch.device("cpu")) == 1  # CPU counts 4 SMs
