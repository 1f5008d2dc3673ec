"""The fused MoE Triton kernel (interpreted) against its torch reference, and the reference against a
per-expert loop written from the definition."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import DTYPES, TOLERANCES
from kvrelay.kernels import moe_reference, reference
from kvrelay.kernels.registry import get_ops
from kvrelay.kernels.triton_moe import fused_moe, moe_align


def _experts(e: int, h: int, i: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn((e, 2 * i, h), generator=g) * h**-0.5).to(dtype)
    w2 = (torch.randn((e, h, i), generator=g) * i**-0.5).to(dtype)
    return w13, w2


def _route(t: int, e: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    probs = torch.randn((t, e), generator=g).softmax(-1)
    w, ids = probs.topk(k, dim=-1)
    return w / w.sum(-1, keepdim=True), ids


def _by_definition(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if not 0 <= e < w13.shape[0]:
                continue
            gate, up = F.linear(x[t], w13[e]).chunk(2)
            out[t] += topk_weights[t, j] * F.linear(F.silu(gate) * up, w2[e]).float()
    return out.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "t,e,k,h,i", [(1, 4, 1, 32, 48), (7, 8, 2, 40, 24), (37, 8, 2, 64, 96), (9, 16, 8, 48, 40), (5, 64, 8, 32, 16)]
)
def test_fused_moe_matches_reference(t, e, k, h, i, dtype):
    w13, w2 = _experts(e, h, i, dtype, seed=t)
    x = (torch.randn((t, h), generator=torch.Generator().manual_seed(5)) * 0.5).to(dtype)
    weights, ids = _route(t, e, k, seed=e + k)
    want = moe_reference.fused_moe(x, w13, w2, weights, ids)
    got = fused_moe(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == (t, h)
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCES[dtype])
    if dtype == torch.float32:
        torch.testing.assert_close(want, _by_definition(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_experts_with_zero_one_and_every_token():
    t, e, k, h, i = 12, 6, 2, 32, 40
    w13, w2 = _experts(e, h, i, torch.float32, seed=3)
    x = torch.randn((t, h), generator=torch.Generator().manual_seed(6))
    ids = torch.zeros((t, k), dtype=torch.int64)  # expert 0: every token
    ids[:, 1] = 3  # expert 3: every token too
    ids[4, 1] = 5  # expert 5: one token (4's second choice); experts 1, 2 and 4 get none
    weights = torch.rand((t, k), generator=torch.Generator().manual_seed(7))
    want = _by_definition(x, w13, w2, weights, ids)
    torch.testing.assert_close(moe_reference.fused_moe(x, w13, w2, weights, ids), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), want, atol=1e-5, rtol=1e-5)


def test_ids_outside_the_local_experts_contribute_nothing():
    # Expert parallelism: a rank holding experts [4, 8) sees ids shifted by -4, so 0..3 become -4..-1.
    t, h, i = 10, 32, 24
    w13, w2 = _experts(8, h, i, torch.float32, seed=9)
    x = torch.randn((t, h), generator=torch.Generator().manual_seed(1))
    weights, ids = _route(t, 8, 2, seed=2)
    full = moe_reference.fused_moe(x, w13, w2, weights, ids)
    low = fused_moe(x, w13[:4], w2[:4], weights, ids.masked_fill(ids >= 4, -1))
    high = fused_moe(x, w13[4:], w2[4:], weights, ids - 4)
    torch.testing.assert_close(low + high, full, atol=1e-5, rtol=1e-5)
    ref_high = moe_reference.fused_moe(x, w13[4:], w2[4:], weights, ids - 4)
    torch.testing.assert_close(high, ref_high, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,k", [(3, 2), (40, 8)])
def test_int8_experts(t, k, dtype):
    e, h, i = 8, 48, 32
    w13, w2 = _experts(e, h, i, torch.float32, seed=11)
    q13, s13 = reference.quantize_int8(w13.reshape(e * 2 * i, h))
    q2, s2 = reference.quantize_int8(w2.reshape(e * h, i))
    q13, s13, q2, s2 = q13.view(e, 2 * i, h), s13.view(e, 2 * i), q2.view(e, h, i), s2.view(e, h)
    x = torch.randn((t, h), generator=torch.Generator().manual_seed(12)).to(dtype)
    weights, ids = _route(t, e, k, seed=13)
    want = moe_reference.fused_moe(x, q13, q2, weights, ids, s13, s2)
    got = fused_moe(x, q13, q2, weights, ids, s13, s2)
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCES[dtype])
    # and the int8 result is close to the unquantised experts'
    full = moe_reference.fused_moe(x.float(), w13, w2, weights, ids)
    torch.testing.assert_close(want.float(), full, atol=0.05, rtol=0.05)


def _fp8_experts(e: int, h: int, i: int, seed: int):
    """Per expert, per output channel float8_e4m3fn (as MoEWeights.quantize_experts), and the fp32 originals."""
    w13, w2 = _experts(e, h, i, torch.float32, seed=seed)
    q13, s13 = reference.quantize_fp8(w13.reshape(e * 2 * i, h))
    q2, s2 = reference.quantize_fp8(w2.reshape(e * h, i))
    return (q13.view(e, 2 * i, h), q2.view(e, h, i), s13.view(e, 2 * i), s2.view(e, h)), (w13, w2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fp8_reference_is_a_per_expert_loop_of_dense_fp8_linear(dtype):
    e, h, i, t, k = 8, 48, 40, 9, 2
    (q13, q2, s13, s2), _ = _fp8_experts(e, h, i, seed=21)
    x = torch.randn((t, h), generator=torch.Generator().manual_seed(22)).to(dtype)
    weights, ids = _route(t, e, k, seed=23)
    want = torch.zeros((t, h))
    for tok in range(t):  # one (token, expert) pair at a time through the dense W8A8 linear
        for j in range(k):
            ex = int(ids[tok, j])
            gate, up = reference.fp8_linear(x[tok : tok + 1], q13[ex], s13[ex]).chunk(2, dim=-1)
            y = reference.fp8_linear(F.silu(gate) * up, q2[ex], s2[ex])
            want[tok] += weights[tok, j] * y[0].float()
    got = moe_reference.fused_moe(x, q13, q2, weights, ids, s13, s2)
    assert got.dtype == dtype
    # Same arithmetic; only the fp32 matmul's summation order differs between a 1-row and a many-row
    # product (~1e-7 relative), which can move an output by one ulp of the dtype, or rarely tip one
    # activation across an fp8 rounding boundary in the down projection (one term of the sum off
    # by <= 2^-4 of itself): fp32 within 1e-5, 16-bit dtypes within a couple of their ulps.
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else TOLERANCES[dtype]
    torch.testing.assert_close(got.float(), want.to(dtype).float(), **tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("t,k", [(1, 1), (3, 2), (40, 8)])
def test_fp8_experts_kernel_matches_reference(t, k, dtype):
    e, h, i = 8, 48, 40
    (q13, q2, s13, s2), (w13, w2) = _fp8_experts(e, h, i, seed=31)
    x = torch.randn((t, h), generator=torch.Generator().manual_seed(32)).to(dtype)
    weights, ids = _route(t, e, k, seed=33)
    want = moe_reference.fused_moe(x, q13, q2, weights, ids, s13, s2)
    got = fused_moe(x, q13, q2, weights, ids, s13, s2)  # the interpreter runs tl.dot on fp8 operands
    assert got.dtype == dtype and got.shape == (t, h)
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCES[dtype])
    # W8A8 on both GEMMs: e4m3's 3 mantissa bits (<= 2^-4 relative per element) average down over
    # the sums to ~6% relative error against the unquantised experts here.
    full = moe_reference.fused_moe(x.float(), w13, w2, weights, ids)
    assert float((want.float() - full).norm() / full.norm()) < 0.1


def test_fp8_experts_with_zero_one_and_every_token_and_foreign_ids():
    t, e, k, h, i = 12, 6, 2, 32, 40
    (q13, q2, s13, s2), _ = _fp8_experts(e, h, i, seed=41)
    x = torch.randn((t, h), generator=torch.Generator().manual_seed(42))
    ids = torch.zeros((t, k), dtype=torch.int64)  # expert 0: every token
    ids[:, 1] = 3
    ids[4, 1] = 5  # expert 5: one token; 1, 2 and 4 none
    ids[7, 1] = -2  # another rank's expert: contributes nothing
    weights = torch.rand((t, k), generator=torch.Generator().manual_seed(43))
    want = moe_reference.fused_moe(x, q13, q2, weights, ids, s13, s2)
    torch.testing.assert_close(fused_moe(x, q13, q2, weights, ids, s13, s2), want, atol=1e-5, rtol=1e-5)
    alone = moe_reference.fused_moe(x[7:8], q13, q2, weights[7:8, :1], ids[7:8, :1], s13, s2)
    torch.testing.assert_close(want[7:8], alone, atol=1e-6, rtol=1e-6)


def test_fp8_experts_split_over_two_ranks_sum_to_the_whole():
    # Expert parallelism: each rank quantizes only its experts, per expert and channel, so its shard
    # equals the slice of one process's fp8 experts; x (and so its per-token scales) is whole on
    # every rank. Top-2: each token's sum is a + b on one rank or (a + 0) + (0 + b) over two: exact.
    t, e, h, i = 10, 8, 32, 24
    (q13, q2, s13, s2), (w13, _) = _fp8_experts(e, h, i, seed=51)
    lo13, lo_s13 = reference.quantize_fp8(w13[:4].reshape(-1, h))
    assert torch.equal(lo13.view(torch.uint8), q13[:4].reshape(-1, h).view(torch.uint8))
    assert torch.equal(lo_s13, s13[:4].reshape(-1))
    x = torch.randn((t, h), generator=torch.Generator().manual_seed(52))
    weights, ids = _route(t, e, 2, seed=53)
    full = moe_reference.fused_moe(x, q13, q2, weights, ids, s13, s2)
    for moe in (moe_reference.fused_moe, fused_moe):
        low = moe(x, q13[:4], q2[:4], weights, ids.masked_fill(ids >= 4, -1), s13[:4], s2[:4])
        high = moe(x, q13[4:], q2[4:], weights, ids - 4, s13[4:], s2[4:])
        torch.testing.assert_close(low + high, full, atol=1e-6 if moe is fused_moe else 0, rtol=1e-6)


def test_fp8_experts_without_scales_are_refused():
    (q13, q2, _, _), _ = _fp8_experts(4, 32, 16, seed=0)
    weights, ids = _route(3, 4, 2, seed=0)
    with pytest.raises(ValueError, match="float8_e4m3fn experts need per-output-channel w13_scale"):
        moe_reference.fused_moe(torch.zeros(3, 32), q13, q2, weights, ids)


def test_fp8_experts_on_a_gpu_without_fp8_tensor_cores_get_one_clear_error(monkeypatch):
    from kvrelay.kernels import triton_moe

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))  # an A100
    with pytest.raises(ValueError, match=r"compute capability 8\.9\+.*this GPU is 8\.0; use --quantization int8"):
        triton_moe.check_fp8_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))  # an H100
    triton_moe.check_fp8_device(torch.device("cuda", 0))


def test_moe_align_groups_and_pads_by_expert():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [5, -1]])  # 5 and -1: not this rank's experts (E=4)
    slots, block_expert = moe_align(ids, num_experts=4, block_m=2)
    n = ids.numel()
    assert block_expert.tolist() == [0, 1, 2, 2, -1, -1, -1, -1][: block_expert.numel()]
    assert slots[:2].tolist() == [1, 4]  # expert 0: slots (0, 1) and (2, 0)
    assert slots[2:4].tolist() == [3, n]  # expert 1: one slot and a pad
    assert slots[4:8].tolist() == [0, 2, 5, n]  # expert 2: three slots, padded to four


def test_registry_exposes_fused_moe_on_every_backend():
    assert get_ops("torch").fused_moe is moe_reference.fused_moe
    assert get_ops("triton").fused_moe is fused_moe


def test_mismatched_shapes_are_named():
    w13, w2 = _experts(4, 32, 16, torch.float32, seed=0)
    weights, ids = _route(3, 4, 2, seed=0)
    with pytest.raises(ValueError, match=r"x must be \[tokens, 32\]"):
        moe_reference.fused_moe(torch.zeros(3, 16), w13, w2, weights, ids)
    with pytest.raises(ValueError, match=r"w2 must be \[4, 32, 16\]"):
        fused_moe(torch.zeros(3, 32), w13, w2[:, :, :8], weights, ids)


def test_engine_on_a_tiny_mixtral_triton_matches_torch(tmp_path):
    import shutil

    import transformers
    from kvrelay.engine.engine_args import EngineArgs
    from kvrelay.engine.llm_engine import LLMEngine
    from kvrelay.engine.sampling_params import SamplingParams

    from kvrelay.models import BUNDLED_MODEL

    config = transformers.MixtralConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2, max_position_embeddings=256)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED_MODEL / name, tmp_path / name)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        engine = LLMEngine(EngineArgs(model=str(tmp_path), kernel_backend=backend, device="cpu",
                                      num_kv_blocks=32, max_num_batched_tokens=8))
        for i, prompt in enumerate(["Once upon a time, there was a dog", "The cat"]):
            engine.add_request(prompt, params, request_id=str(i))
        out: dict[str, list[int]] = {}
        while engine.has_work():
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        tokens[backend] = out
    assert all(len(t) == 6 for t in tokens["torch"].values())
    assert tokens["triton"] == tokens["torch"]
