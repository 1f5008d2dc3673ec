"""Mixture-of-experts families (Mixtral, Qwen2-MoE with a shared expert, Qwen3-MoE): greedy tokens
identical to transformers at batch 1 and 16, with chunked prefill and prefix-cache hits, fp32
logprobs within 1e-4, the config fields, int8 and fp8 experts, load counters and the load-time errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import PROMPTS, greedy, hf_greedy, hf_logprobs, make_engine, run_engine
from kvrelay.engine.errors import ModelLoadError
from kvrelay.engine.parallel.state import ParallelState, get_parallel_state, set_parallel_state
from kvrelay.engine.sampling_params import SamplingParams
from tiny_models import save_tiny_model

MODELS = ["mixtral", "qwen2_moe", "qwen3_moe"]
# 16 distinct prompts for one batch: the six stories, each with a different tail.
TAILS = ["and", "then", "she", "said", "the", "dog", "ran", "home", "with", "a", "big", "red", "ball", "to", "the",
         "sun"]
BATCH16 = [f"{PROMPTS[i % len(PROMPTS)]} {tail}" for i, tail in enumerate(TAILS)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("moe_models")
    return {
        "mixtral": save_tiny_model(root / "mixtral", "mixtral"),
        # Layer 1 dense (mlp_only_layers), layers 0 and 2 sparse with a shared expert.
        "qwen2_moe": save_tiny_model(root / "qwen2_moe", "qwen2_moe", num_hidden_layers=3, mlp_only_layers=[1]),
        "qwen3_moe": save_tiny_model(root / "qwen3_moe", "qwen3_moe"),
    }


def _check(engine, model_dir, prompts, n) -> None:
    out = run_engine(engine, {str(i): (p, greedy(n)) for i, p in enumerate(prompts)})
    for i, p in enumerate(prompts):
        ids = engine.tokenizer.encode_prompt(p)
        assert out[str(i)] == hf_greedy(str(model_dir), tuple(ids), n), f"prompt {i}: {p!r}"


@pytest.mark.parametrize("name", MODELS)
def test_greedy_matches_transformers_batch_1_and_16(models, name):
    engine = make_engine(models[name])
    for p in PROMPTS[:2]:  # one sequence at a time
        _check(engine, models[name], [p], 16)
    assert len(BATCH16) == 16
    _check(engine, models[name], BATCH16, 8)  # sixteen in one batch
    assert engine.config.architecture == json.loads((models[name] / "config.json").read_text())["architectures"][0]


@pytest.mark.parametrize("name", MODELS)
def test_chunked_prefill_and_prefix_hits_match_transformers(models, name):
    engine = make_engine(models[name], block_size=4, max_num_batched_tokens=7)
    _check(engine, models[name], PROMPTS[2:6], 12)
    before = engine.stats().prefix_cache_hits
    _check(engine, models[name], [PROMPTS[2], PROMPTS[5] + " The end"], 12)
    assert engine.stats().prefix_cache_hits > before


@pytest.mark.parametrize("name", MODELS)
def test_fp32_logprobs_within_1e4_of_transformers(models, name):
    engine = make_engine(models[name], max_num_batched_tokens=6)
    engine.add_request(PROMPTS[2], SamplingParams(max_tokens=16, temperature=0.0, logprobs=10), "x")
    outs = []
    while engine.has_work():
        outs += engine.step()
    ids = engine.tokenizer.encode_prompt(PROMPTS[2])
    ref = hf_logprobs(str(models[name]), ids + [o.new_token_ids[0] for o in outs])
    for j, o in enumerate(outs):
        row = ref[len(ids) - 1 + j]
        for token_id, value in [(o.logprobs[0].token_id, o.logprobs[0].logprob), *o.logprobs[0].top]:
            b = float(row[token_id])
            assert abs(value - b) <= 1e-4 * max(1.0, abs(b)), (j, token_id, value, b)


def test_moe_fields_are_read_from_the_config(models):
    mix = make_engine(models["mixtral"]).config.moe
    assert (mix.num_experts, mix.top_k, mix.expert_intermediate_size, mix.norm_topk_prob) == (8, 2, 128, True)
    assert mix.sparse_layers == (True, True) and mix.shared_expert_intermediate_size == 0
    engine = make_engine(models["qwen2_moe"])
    q2 = engine.config.moe
    assert (q2.num_experts, q2.top_k, q2.expert_intermediate_size, q2.shared_expert_intermediate_size) == (8, 4, 48, 96)
    assert q2.sparse_layers == (True, False, True) and engine.config.qkv_bias
    layers = engine.model.w.layers
    assert layers[1].moe is None and layers[1].gate_up.weight.shape == (256, 64)  # dense: intermediate_size
    assert layers[0].moe.w13.shape == (8, 96, 64) and layers[0].moe.shared_gate.shape == (1, 64)
    q3 = make_engine(models["qwen3_moe"]).config
    assert q3.qk_norm and q3.moe.norm_topk_prob and q3.moe.top_k == 4


def test_expert_load_counts_every_routed_token(models):
    engine = make_engine(models["qwen3_moe"])
    prompt = engine.tokenizer.encode_prompt(PROMPTS[0])
    run_engine(engine, {"a": (PROMPTS[0], greedy(5))})
    load = engine.model.expert_load()
    # Each step's tokens each pick top_k=4 experts in each of the 2 sparse layers.
    assert sum(load.total) == (len(prompt) + 4) * 4 * 2
    assert sum(load.last_step) == 1 * 4 * 2 and load.steps == 5
    assert load.total_imbalance >= 1.0 and load.last_step_imbalance >= 1.0


def test_int8_experts_run(models):
    engine = make_engine(models["mixtral"], quantization="int8")
    moe = engine.model.w.layers[0].moe
    assert moe.w13.dtype == torch.int8 and moe.w13_scale.shape == (8, 256) and moe.w2_scale.shape == (8, 64)
    out = run_engine(engine, {"a": (PROMPTS[0], greedy(8))})
    assert len(out["a"]) == 8


def _fp8_transformers_mixtral(model_dir):
    """transformers' Mixtral with every decoder projection made W8A8 fp8 the way --quantization fp8
    makes it: weights per output channel (experts: per expert), activations per token, through the
    dense reference.fp8_linear. Router, norms, embeddings and LM head stay fp32, as in the engine."""
    import transformers
    from kvrelay.kernels import reference

    class Fp8Linear(torch.nn.Module):
        def __init__(self, lin: torch.nn.Linear):
            super().__init__()
            self.q, self.s = reference.quantize_fp8(lin.weight.detach())
            self.bias = lin.bias

        def forward(self, x):
            return reference.fp8_linear(x, self.q, self.s, self.bias)

    def fp8_experts(experts):
        e, two_i, h = experts.gate_up_proj.shape
        q13, s13 = reference.quantize_fp8(experts.gate_up_proj.detach().reshape(-1, h))
        q2, s2 = reference.quantize_fp8(experts.down_proj.detach().reshape(e * h, -1))
        q13, s13, q2, s2 = q13.view(e, two_i, h), s13.view(e, -1), q2.view(e, h, -1), s2.view(e, -1)

        def forward(hidden, top_k_index, top_k_weights):
            out = torch.zeros_like(hidden)
            for t in range(hidden.shape[0]):
                for j, ex in enumerate(top_k_index[t].tolist()):
                    gate, up = reference.fp8_linear(hidden[t : t + 1], q13[ex], s13[ex]).chunk(2, dim=-1)
                    y = reference.fp8_linear(experts.act_fn(gate) * up, q2[ex], s2[ex])
                    out[t] += top_k_weights[t, j] * y[0]
            return out

        experts.forward = forward

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for layer in model.model.layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, Fp8Linear(child))
        fp8_experts(layer.mlp.experts)
    return model


def test_fp8_experts_match_transformers_with_the_same_fp8_arithmetic(models):
    engine = make_engine(models["mixtral"], quantization="fp8", max_num_batched_tokens=7)
    moe = engine.model.w.layers[0].moe
    assert moe.w13.dtype == torch.float8_e4m3fn and moe.w2.dtype == torch.float8_e4m3fn
    assert moe.w13_scale.shape == (8, 256) and moe.w2_scale.shape == (8, 64)
    assert engine.model.expert_bytes() < make_engine(models["mixtral"]).model.expert_bytes() / 3
    prompts = PROMPTS[:3]
    out = run_engine(engine, {str(i): (p, greedy(10)) for i, p in enumerate(prompts)})
    fp8_hf = _fp8_transformers_mixtral(models["mixtral"])
    for i, p in enumerate(prompts):
        ids = engine.tokenizer.encode_prompt(p)
        with torch.no_grad():
            seq = fp8_hf.generate(torch.tensor([ids]), max_new_tokens=10, min_new_tokens=10, do_sample=False)
        assert out[str(i)] == seq[0, len(ids) :].tolist(), f"prompt {i}: {p!r}"
    # Not a vacuous match: this tiny model's peaked logits make fp8 leave the fp32 tokens quickly.
    assert any(out[str(i)] != hf_greedy(str(models["mixtral"]), tuple(engine.tokenizer.encode_prompt(p)), 10)
               for i, p in enumerate(prompts))
    # Logprobs: the same arithmetic up to fp32 summation order (which could, rarely, tip one
    # activation across an fp8 rounding boundary): within 1e-4, as the fp32 comparison above.
    engine.add_request(PROMPTS[2], SamplingParams(max_tokens=8, temperature=0.0, logprobs=10), "x")
    outs = []
    while engine.has_work():
        outs += engine.step()
    ids = engine.tokenizer.encode_prompt(PROMPTS[2])
    with torch.no_grad():
        ref = fp8_hf(torch.tensor([ids + [o.new_token_ids[0] for o in outs]])).logits[0].float().log_softmax(-1)
    for j, o in enumerate(outs):
        row = ref[len(ids) - 1 + j]
        for token_id, value in [(o.logprobs[0].token_id, o.logprobs[0].logprob), *o.logprobs[0].top]:
            b = float(row[token_id])
            assert abs(value - b) <= 1e-4 * max(1.0, abs(b)), (j, token_id, value, b)


def _edited(tmp_path, src, **changes):
    d = shutil.copytree(src, tmp_path / "edited")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | changes))
    return d


def test_unsupported_router_is_one_clear_error(tmp_path, models):
    d = _edited(tmp_path, models["qwen3_moe"], scoring_func="sigmoid")
    with pytest.raises(ModelLoadError, match=r"router scoring_func='sigmoid' unsupported for Qwen3MoeForCausalLM"):
        make_engine(d)


def test_expert_count_not_divisible_by_the_ep_size_is_one_clear_error(models):
    saved = get_parallel_state()
    set_parallel_state(ParallelState(tp_rank=0, tp_size=3, expert_parallel=True))
    try:
        with pytest.raises(ModelLoadError, match="num_experts 8 is not divisible by the expert-parallel size 3"):
            make_engine(models["mixtral"])
    finally:
        set_parallel_state(saved)


def test_expert_load_is_exported_as_prometheus_metrics(models):
    from kvrelay.kvtransfer.metrics import WorkerMetrics
    from prometheus_client import generate_latest

    engine = make_engine(models["mixtral"])
    run_engine(engine, {"a": (PROMPTS[1], greedy(3))})
    text = generate_latest(WorkerMetrics(engine).registry).decode()
    load = engine.model.expert_load()
    for e, n in enumerate(load.total):
        assert f'kvrelay:moe_expert_tokens_total{{expert="{e}"}} {float(n)}' in text
    assert sum(load.last_step) == 1 * 2 * 2  # one decode token, top-2, two sparse layers
    assert f'kvrelay:moe_expert_load_imbalance{{window="total"}} {load.total_imbalance}' in text
    assert 'kvrelay:moe_expert_tokens_last_step{expert="0"}' in text


def test_moe_tensors_are_recognised_for_the_parallel_loader(models):
    from kvrelay.engine.architectures.moe import is_moe_tensor
    from kvrelay.engine.weights import expected_shapes

    # Mixtral: 2 sparse layers of router + 8 experts x 3; Qwen2-MoE: 2 sparse layers of router +
    # 8 x 3 + shared expert (3) + its gate.
    for name, count in (("mixtral", 2 * (1 + 24)), ("qwen2_moe", 2 * (1 + 24 + 3 + 1))):
        config = make_engine(models[name]).config
        moe = {n for n in expected_shapes(config) if is_moe_tensor(n)}
        assert len(moe) == count
        assert all(".self_attn." not in n and "norm" not in n for n in moe)
        assert not is_moe_tensor("model.layers.1.mlp.gate_proj.weight")  # a dense layer's MLP
    assert is_moe_tensor("model.layers.0.mlp.shared_expert_gate.weight")
    assert is_moe_tensor("model.layers.2.mlp.shared_expert.down_proj.weight")
