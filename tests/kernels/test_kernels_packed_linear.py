"""Linear layers over packed weights: the layout round-trips, the native kernel (AVX2 machines)
equals F.linear within fp32 rounding at every tile and block remainder, and the registry and the
engine pack where, and only where, the kernel exists."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kvrelay.kernels import cpu_native, native_ops, reference
from kvrelay.kernels.registry import get_ops

needs_kernel = pytest.mark.skipif(
    cpu_native.unavailable_reason() is not None or not cpu_native.packed_linear_available(),
    reason="no packed linear kernel on this machine (it needs AVX2 without AVX-512)",
)


def test_pack_round_trips_and_pads_with_zeros():
    w = torch.randn(37, 20)
    packed = reference.pack_linear_weight(w)
    assert packed.data.shape == (3, 20, 16) and packed.out_features == 37
    assert torch.equal(reference.unpack_linear_weight(packed), w)
    assert torch.count_nonzero(packed.data[2, :, 5:]) == 0  # output rows 37..47 do not exist
    x = torch.randn(4, 20)
    assert torch.equal(reference.packed_linear(x, packed), F.linear(x, w))


def test_torch_backend_keeps_weights_as_loaded():
    assert get_ops("torch").prepack_linear(torch.randn(8, 8)) is None


def relative_error(got: torch.Tensor, x, w, bias) -> float:
    want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    return float((got.double() - want).abs().max() / want.abs().max())


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 38, 97, 200])  # tile of 6 rows, row blocks of 96
@pytest.mark.parametrize(("k", "n"), [(64, 3), (100, 37), (512, 1536), (300, 16), (1376, 512)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_native_equals_torch_within_fp32_rounding(rows, k, n, with_bias):
    # k 300: K blocks of 128 with a remainder; n 3 and 37: a panel only partly filled.
    g = torch.Generator().manual_seed(rows * 7919 + k * 31 + n)
    x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    got = native_ops.packed_linear(x, native_ops.prepack_linear(w), bias)
    assert got.shape == (rows, n)
    # F.linear (MKL) itself lands at 1e-8 .. 4e-7 of the largest output here.
    assert relative_error(got, x, w, bias) < 2e-6


@needs_kernel
def test_native_takes_strided_and_batched_inputs():
    w = torch.randn(24, 32)
    packed = native_ops.prepack_linear(w)
    wide = torch.randn(10, 48)
    strided = wide[:, 8:40]  # rows 48 floats apart
    assert relative_error(native_ops.packed_linear(strided, packed), strided, w, None) < 2e-6
    batched = torch.randn(2, 3, 32)
    got = native_ops.packed_linear(batched, packed)
    assert got.shape == (2, 3, 24)
    assert relative_error(got, batched, w, None) < 2e-6
    assert native_ops.packed_linear(torch.empty(0, 32), packed).shape == (0, 24)
    with pytest.raises(ValueError, match="33 features, the weight expects 32"):
        native_ops.packed_linear(torch.randn(2, 33), packed)
    with pytest.raises(ValueError, match=r"bias has shape \(23,\), the weight expects \(24,\)"):
        native_ops.packed_linear(torch.randn(2, 32), packed, torch.zeros(23))


@needs_kernel
def test_native_backend_packs_fp32_only():
    assert native_ops.prepack_linear(torch.randn(8, 8, dtype=torch.bfloat16)) is None
    w = torch.randn(8, 8, dtype=torch.bfloat16)
    x = torch.randn(3, 8, dtype=torch.bfloat16)  # not fp32: the torch reference answers
    assert torch.equal(native_ops.packed_linear(x, reference.pack_linear_weight(w)), F.linear(x, w))


@needs_kernel
def test_engine_packs_projections_and_lm_head(tmp_path):
    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(kernel_backend="native"))  # bundled stories260K: tied embeddings
    w = engine.model.w
    assert all(lin.weight is None and lin.packed is not None
               for layer in w.layers for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    assert w.lm_head_packed is not None and w.lm_head is w.embed  # tied: the embedding stays
    int8 = LLMEngine(EngineArgs(kernel_backend="native", quantization="int8"))
    assert int8.model.w.layers[0].qkv.packed is None  # int8 layers keep their own kernel
