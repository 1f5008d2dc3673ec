"""FP8 W8A8: per-row float8_e4m3fn quantization (Triton, interpreted) and the linear vs torch."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DTYPES, randn
from kvrelay.kernels import reference
from kvrelay.kernels.triton_fp8 import fp8_linear, quantize_fp8


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,k", [(1, 8), (48, 172), (5, 3000)])
def test_quantize_fp8_matches_the_reference_exactly(rows, k, dtype):
    x = randn((rows, k), dtype, 0) * 3
    got_q, got_scale = quantize_fp8(x)
    want_q, want_scale = reference.quantize_fp8(x)
    assert got_q.dtype == torch.float8_e4m3fn and got_scale.shape == (rows,)
    assert torch.equal(got_scale, want_scale)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


def test_quantize_fp8_uses_the_whole_range_and_survives_zero_rows():
    x = torch.zeros((2, 40))
    x[0, 3] = -7.0
    x[0, 5] = 2.0
    q, scale = quantize_fp8(x)
    assert q[0, 3].float() == -448.0 and scale[0] == pytest.approx(7.0 / 448.0)
    assert q[1].float().abs().sum() == 0 and torch.isfinite(scale).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp8_linear_matches_the_reference_and_tracks_the_float_product(m, with_bias, dtype):
    n, k = 96, 176
    w = randn((n, k), torch.float32, 0)
    w8, w_scale = reference.quantize_fp8(w)
    x = randn((m, k), dtype, 1)
    bias = randn((n,), dtype, 2) if with_bias else None
    got = fp8_linear(x, w8, w_scale, bias)
    want = reference.fp8_linear(x, w8, w_scale, bias)
    assert got.dtype == dtype and got.shape == (m, n)
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    # e4m3 keeps 3 mantissa bits: ~3% relative error per element, far less over a K=176 sum.
    exact = (x.float() @ w.t() + (bias.float() if bias is not None else 0)).to(dtype).float()
    assert float((want.float() - exact).norm() / exact.norm()) < 0.06
