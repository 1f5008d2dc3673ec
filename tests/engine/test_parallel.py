"""Tensor and pipeline parallelism on CPU (gloo, real worker processes): greedy tokens identical to
one process and to transformers, logprobs within 1e-4, and a worker killed with SIGKILL fails the
engine at once instead of hanging."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from helpers import PROMPTS, hf_greedy, make_engine
from kvrelay.engine.model_config import load_model_config
from kvrelay.engine.parallel.executor import WorkerDiedError
from kvrelay.engine.parallel.layers import (
    check_parallel,
    cut,
    kv_head_range,
    local_config,
    shard_plan,
    stage_layers,
)
from kvrelay.engine.parallel.state import ParallelState
from kvrelay.engine.sampling_params import SamplingParams
from tiny_models import save_tiny_model

from kvrelay.models import BUNDLED_MODEL

N = 12
KV = {"kv_cache_memory": 4 * 2**20}


def _run(engine, prompts=PROMPTS[:4], n=N) -> tuple[dict[str, list[int]], dict[str, list[float]]]:
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, logprobs=0)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, str(i))
    tokens = {str(i): [] for i in range(len(prompts))}
    lps = {str(i): [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)
            lps[o.request_id].extend(lp.logprob for lp in o.logprobs or [])
    return tokens, lps


def _assert_same(ref, got):
    ref_tokens, ref_lps = ref
    tokens, lps = got
    assert tokens == ref_tokens
    for rid in ref_lps:
        assert torch.allclose(torch.tensor(lps[rid]), torch.tensor(ref_lps[rid]), atol=1e-4, rtol=0), rid


@pytest.fixture(scope="module")
def stories_ref():
    engine = make_engine(BUNDLED_MODEL, **KV)
    out = _run(engine)
    for i, p in enumerate(PROMPTS[:4]):  # the single process is transformers' greedy output
        assert out[0][str(i)] == hf_greedy(str(BUNDLED_MODEL), tuple(engine.tokenizer.encode_prompt(p)), N)
    return out


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_stories_parallel_matches_one_process(stories_ref, tp, pp):
    engine = make_engine(BUNDLED_MODEL, tensor_parallel_size=tp, pipeline_parallel_size=pp, **KV)
    try:
        assert len(engine.executor.pids) == tp * pp
        _assert_same(stories_ref, _run(engine))
    finally:
        engine.close()
    assert not any(p.is_alive() for p in engine.executor.procs)


def test_mp_backend_at_world_size_1_matches_one_process(stories_ref):
    """--distributed-executor-backend mp: the worker path with one rank (what one GPU can check)."""
    engine = make_engine(BUNDLED_MODEL, distributed_executor_backend="mp", **KV)
    try:
        assert len(engine.executor.pids) == 1
        _assert_same(stories_ref, _run(engine))
    finally:
        engine.close()


def test_uni_backend_refuses_several_ranks():
    with pytest.raises(ValueError, match="uni runs one process.*= 2 ranks"):
        make_engine(BUNDLED_MODEL, distributed_executor_backend="uni", tensor_parallel_size=2, **KV)


def test_int8_tp2_matches_int8_in_one_process():
    # row-parallel shards are quantized with the whole rows' scales: the same int8 weights
    ref = _run(make_engine(BUNDLED_MODEL, quantization="int8", **KV), PROMPTS[:2])
    engine = make_engine(BUNDLED_MODEL, quantization="int8", tensor_parallel_size=2, **KV)
    try:
        _assert_same(ref, _run(engine, PROMPTS[:2]))
    finally:
        engine.close()


@pytest.mark.parametrize(
    "arch,overrides,tp,pp",
    [
        ("qwen2", {"num_key_value_heads": 1}, 2, 1),  # qkv bias; one KV head replicated on both ranks
        ("qwen3", {"num_hidden_layers": 3}, 2, 2),  # q/k norm; 3 layers over 2 stages
        ("phi3", {}, 2, 1),  # q/k/v and gate/up fused in the checkpoint
        # per-layer windows and rope bases split over stages; sandwich norms, soft-caps
        ("gemma3", {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention",
                                                            "sliding_attention"]}, 1, 2),
    ],
)
def test_random_tiny_models_match_transformers(tmp_path, arch, overrides, tp, pp):
    model = save_tiny_model(tmp_path / arch, arch, **overrides)
    ref = _run(make_engine(model, **KV), PROMPTS[:3], 10)
    engine = make_engine(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, **KV)
    try:
        got = _run(engine, PROMPTS[:3], 10)
    finally:
        engine.close()
    _assert_same(ref, got)
    for i, p in enumerate(PROMPTS[:3]):
        ids = tuple(engine.tokenizer.encode_prompt(p))
        assert got[0][str(i)] == hf_greedy(str(model), ids, 10)


@pytest.mark.parametrize("arch,expert_parallel", [("mixtral", False), ("qwen2_moe", True)])
def test_moe_models_under_tensor_and_expert_parallelism_match_one_process(tmp_path, arch, expert_parallel):
    """Attention split over 2 ranks; experts replicated, or (--enable-expert-parallel) half per rank,
    summed by one all-reduce; Qwen2-MoE's shared expert and sigmoid gate stay replicated."""
    model = save_tiny_model(tmp_path / arch, arch)
    ref = _run(make_engine(model, **KV), PROMPTS[:3], 10)
    engine = make_engine(model, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **KV)
    try:
        _assert_same(ref, _run(engine, PROMPTS[:3], 10))
    finally:
        engine.close()
    with pytest.raises(ValueError, match="pipeline-parallel-size must be 1"):
        make_engine(model, pipeline_parallel_size=2, **KV)


def test_killed_worker_fails_the_engine_without_hanging():
    engine = make_engine(BUNDLED_MODEL, tensor_parallel_size=2, **KV)
    try:
        engine.add_request("Once upon a time", SamplingParams(max_tokens=400, temperature=0.0), "r")
        engine.step()
        os.kill(engine.executor.pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        with pytest.raises(WorkerDiedError, match=r"rank 1 .*exit code -9"):
            while time.monotonic() < deadline:
                engine.step()
        assert time.monotonic() < deadline
        assert engine.has_work()  # so an idle step loop also steps, and fails
        deadline = time.monotonic() + 10
        while any(p.is_alive() for p in engine.executor.procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(p.is_alive() for p in engine.executor.procs)  # the survivor is killed too
    finally:
        engine.close()


def test_workers_die_with_a_killed_driver():
    import subprocess
    import sys

    code = ("import time\nfrom kvrelay.engine.engine_args import EngineArgs\n"
            "from kvrelay.engine.llm_engine import LLMEngine\n"
            "e = LLMEngine(EngineArgs(tensor_parallel_size=2, kv_cache_memory=4 << 20))\n"
            "print(*e.executor.pids, flush=True)\ntime.sleep(120)\n")
    driver = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 2
    finally:
        driver.kill()
        driver.wait()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_worker_error_at_load_is_reported_with_its_cause(tmp_path):
    model = save_tiny_model(tmp_path / "m", "llama")
    (model / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(Exception, match="safetensors|header"):
        make_engine(model, tensor_parallel_size=2, **KV)


# ---- layout, without processes -------------------------------------------------------------


def test_kv_heads_are_split_or_replicated_like_vllm():
    assert [kv_head_range(4, 2, r) for r in range(2)] == [(0, 2), (2, 4)]
    assert [kv_head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_range(1, 2, r) for r in range(2)] == [(0, 1), (0, 1)]


def test_stages_are_contiguous_and_cover_every_layer():
    assert [stage_layers(5, 2, s) for s in range(2)] == [(0, 3), (3, 5)]
    assert [stage_layers(4, 4, s) for s in range(4)] == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_unsplittable_sizes_are_one_clear_error():
    cfg = load_model_config(BUNDLED_MODEL)  # 8 heads, 4 KV heads, intermediate 172, 5 layers
    with pytest.raises(ValueError, match="--tensor-parallel-size 3: the model's 8 attention heads"):
        check_parallel(cfg, 3, 1)
    with pytest.raises(ValueError, match="--pipeline-parallel-size 6 exceeds the model's 5 layers"):
        check_parallel(cfg, 1, 6)
    with pytest.raises(ValueError, match="intermediate_size 172"):
        check_parallel(cfg, 8, 1)


def test_shards_rebuild_the_whole_tensors():
    cfg = load_model_config(BUNDLED_MODEL)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(cfg.q_size, cfg.hidden_size, generator=gen)
    o = torch.randn(cfg.hidden_size, cfg.q_size, generator=gen)
    emb = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen)

    def shard(name, t, rank, tp=2):
        return cut(shard_plan(name, tuple(t.shape), cfg, rank, tp),
                   lambda d, a, b: t if d is None else t.narrow(d, a, b - a), tuple(t.shape))

    p = "model.layers.0."
    assert torch.equal(torch.cat([shard(p + "self_attn.q_proj.weight", q, r) for r in range(2)]), q)
    assert torch.equal(torch.cat([shard(p + "self_attn.o_proj.weight", o, r) for r in range(2)], 1), o)
    # vocabulary rows padded to a multiple of the TP size (512 over 3 ranks: 171 each)
    parts = [shard("model.embed_tokens.weight", emb, r, 3) for r in range(3)]
    assert {t.shape[0] for t in parts} == {171} and torch.equal(torch.cat(parts)[: cfg.vocab_size], emb)
    assert not torch.cat(parts)[cfg.vocab_size:].any()
    state = ParallelState(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2)
    local = local_config(cfg, state)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.num_layers) == (4, 2, 86, 2)


def test_int8_column_shards_equal_slices_of_the_whole_quantization():
    from kvrelay.kernels.registry import get_ops

    ops = get_ops("torch")
    w = torch.randn(64, 32)
    full_q, full_s = ops.quantize_int8(w)
    for rank in range(2):
        q, s = ops.quantize_int8(w[rank * 32:(rank + 1) * 32])  # per-row scales: the shard's own rows
        assert torch.equal(q, full_q[rank * 32:(rank + 1) * 32]) and torch.equal(s, full_s[rank * 32:(rank + 1) * 32])
