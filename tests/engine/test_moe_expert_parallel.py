"""Expert parallelism through the engine's own workers (2 gloo processes, --enable-expert-parallel):
each rank loads only its half of the experts, attention is split over the same two ranks, and the
ranks' partial MoE outputs are summed, giving one process's greedy tokens and logprobs."""

from __future__ import annotations

import pytest
from helpers import PROMPTS, make_engine
from kvrelay.engine.sampling_params import SamplingParams
from tiny_models import save_tiny_model

KV = {"kv_cache_memory": 4 * 2**20, "max_num_batched_tokens": 7, "block_size": 4}


def _run(engine) -> tuple[dict, dict]:
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0, logprobs=5)
    for i, p in enumerate(PROMPTS[:4]):
        engine.add_request(p, params, str(i))
    tokens = {str(i): [] for i in range(4)}
    logprobs = {str(i): [] for i in range(4)}
    while engine.has_work():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            logprobs[o.request_id] += [lp.logprob for lp in o.logprobs or []]
    return tokens, logprobs


@pytest.mark.parametrize("arch,quantization", [("mixtral", None), ("qwen2_moe", None), ("mixtral", "int8")])
def test_ep2_equals_ep1_and_each_rank_loads_half_the_experts(tmp_path, arch, quantization):
    model = save_tiny_model(tmp_path / arch, arch)
    one_engine = make_engine(model, quantization=quantization, **KV)
    one = _run(one_engine)
    engine = make_engine(model, quantization=quantization, tensor_parallel_size=2, enable_expert_parallel=True, **KV)
    try:
        got = _run(engine)
        held = engine.executor.held
        # kvrelay:moe_expert_tokens under EP: rank 0 routes every token, so its counters are one
        # process's (each worker zeroed them after start-up, as one process does).
        load, want = engine.stats().expert_load(), one_engine.stats().expert_load()
    finally:
        engine.close()
    assert load.total == want.total and load.steps == want.steps and sum(load.total) > 0
    assert got[0] == one[0]
    for rid, lps in got[1].items():  # the ranks' partial sums associate differently from one process
        assert all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(lps, one[1][rid], strict=True)), rid
    # int8: per expert, per output channel scales, so a rank's experts quantize as in one process.
    assert [h["expert_bytes"] * 2 for h in held] == [one_engine.model.expert_bytes()] * 2
