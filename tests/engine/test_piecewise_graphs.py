"""Piecewise CUDA graphs for steps with prefill (runner/piecewise_graphs.py). On CPU the segments run
uncaptured through the same fixed buffers, padding and eager attention, so the wiring is checked
here; the capture itself runs where CUDA is present (scripts/device_check.sh 1)."""

from __future__ import annotations

import pytest
import torch
from helpers import PROMPTS, greedy, make_engine, run_engine
from kvrelay.engine.runner.piecewise_graphs import PiecewiseGraphs, token_buckets
from kvrelay.engine.sampling_params import SamplingParams
from tiny_models import save_tiny_model

from kvrelay.models import BUNDLED_MODEL


def _with_segments(engine, sizes: list[int]) -> PiecewiseGraphs:
    pw = PiecewiseGraphs(engine.model, engine.kv_cache, max(sizes))
    pw.capture(sizes, use_graphs=False)
    engine.runner.piecewise = pw
    return pw


def _requests() -> dict[str, tuple]:
    reqs = {f"g{i}": (p, greedy(24)) for i, p in enumerate(PROMPTS)}
    reqs["again"] = (PROMPTS[5], greedy(10))  # a prefix-cache hit: a chunk that starts past 0
    reqs["seeded"] = (PROMPTS[2], SamplingParams(max_tokens=20, temperature=0.8, seed=5, stop=[" the"]))
    return reqs


@pytest.mark.parametrize("budget", [2048, 24])  # whole prompts; 24-token chunks mixed with decodes
def test_segments_give_the_eager_tokens(budget):
    plain = make_engine(BUNDLED_MODEL, device="cpu", max_num_batched_tokens=budget)
    pieces = make_engine(BUNDLED_MODEL, device="cpu", max_num_batched_tokens=budget)
    pw = _with_segments(pieces, [16, 32, 64, 128])  # most steps padded up to their bucket
    want, got = run_engine(plain, _requests()), run_engine(pieces, _requests())
    assert got == want
    assert pw.steps > 0
    assert pieces.pool.num_free == pieces.pool.num_blocks


def test_padding_rows_write_no_kv():
    engine = make_engine(BUNDLED_MODEL, device="cpu")
    pw = _with_segments(engine, [64])
    before = engine.kv_cache.clone()
    run_engine(engine, {"one": (PROMPTS[0], greedy(1))})  # 5 prompt tokens padded to 64 rows
    changed = (engine.kv_cache != before).flatten(2).any(-1)  # [layer, k/v, block]
    assert pw.steps == 1
    assert int(changed.any(0).any(0).sum()) == 1  # the one block the prompt's 5 tokens went to


def test_steps_past_the_largest_bucket_run_eagerly():
    engine = make_engine(BUNDLED_MODEL, device="cpu")
    pw = _with_segments(engine, [4])
    out = run_engine(engine, {"r": (PROMPTS[5], greedy(3))})  # a prompt over 4 tokens, then 1-token decodes
    assert out == run_engine(make_engine(BUNDLED_MODEL, device="cpu"), {"r": (PROMPTS[5], greedy(3))})
    assert pw.steps == 2  # the two decodes that follow the prefill; the prefill itself ran eagerly


def test_moe_segments_give_the_eager_tokens_and_count_no_padding_row(tmp_path):
    """MoE layers run inside the segments; the padding rows route like any row but the expert load
    counts the real tokens only (the mask follows the slots inside each segment)."""
    model = save_tiny_model(tmp_path / "qwen2_moe", "qwen2_moe", num_hidden_layers=3, mlp_only_layers=[1])
    plain = make_engine(model, device="cpu", max_num_batched_tokens=24)
    pieces = make_engine(model, device="cpu", max_num_batched_tokens=24)
    pw = _with_segments(pieces, [16, 32, 64])
    reqs = {f"g{i}": (p, greedy(6)) for i, p in enumerate(PROMPTS[:4])}
    assert run_engine(pieces, reqs) == run_engine(plain, reqs)
    assert pw.steps > 0
    want, got = plain.model.expert_load(), pieces.model.expert_load()
    assert sum(want.total) > 0 and got.total == want.total and got.steps == want.steps
    assert pieces.model.real_rows is None


def test_token_buckets():
    assert token_buckets(2048) == [256, 512, 1024, 2048]
    assert token_buckets(3000) == [256, 512, 1024, 2048, 4096]
    assert token_buckets(100) == [256]


def test_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="--piecewise-cuda-graphs needs --device cuda"):
        make_engine(BUNDLED_MODEL, device="cpu", piecewise_cuda_graphs=True)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("budget", [2048, 24])
def test_captured_graphs_give_the_eager_tokens(budget):  # pragma: no cover - CUDA only
    kw = {"device": "cuda", "kv_cache_memory": 64 * 2**20, "max_num_batched_tokens": budget}
    eager = make_engine(BUNDLED_MODEL, enforce_eager=True, **kw)
    graphs = make_engine(BUNDLED_MODEL, piecewise_cuda_graphs=True, **kw)
    assert run_engine(graphs, _requests()) == run_engine(eager, _requests())
    assert graphs.runner.piecewise.steps > 0
    with pytest.raises(ValueError, match="contradicts --enforce-eager"):
        make_engine(BUNDLED_MODEL, enforce_eager=True, piecewise_cuda_graphs=True, **kw)


@cuda
def test_captured_moe_graphs_give_the_eager_tokens_and_expert_load(tmp_path):  # pragma: no cover - CUDA only
    """Decode and piecewise graphs of an MoE model: the eager tokens, and the eager expert load (the
    mask of real rows is recomputed inside each replay, so padding rows are never counted)."""
    model = save_tiny_model(tmp_path / "qwen2_moe", "qwen2_moe", num_hidden_layers=3, mlp_only_layers=[1])
    kw = {"device": "cuda", "kv_cache_memory": 64 * 2**20, "max_num_batched_tokens": 24}
    eager = make_engine(model, enforce_eager=True, **kw)
    graphs = make_engine(model, piecewise_cuda_graphs=True, **kw)
    reqs = {f"g{i}": (p, greedy(6)) for i, p in enumerate(PROMPTS[:4])}
    assert run_engine(graphs, reqs) == run_engine(eager, reqs)
    assert graphs.runner.piecewise.steps > 0 and graphs.runner.graph_steps > 0
    want, got = eager.model.expert_load(), graphs.model.expert_load()
    assert got.total == want.total and got.steps == want.steps
